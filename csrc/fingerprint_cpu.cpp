// CPU fingerprint: lane sums of a byte buffer, multi-threaded with ATen's pool.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RT_FP_X86 1
#endif

#include "fingerprint.h"

// The SIMD templates below take vector arguments by value, which GCC flags as
// an ABI change without AVX enabled; they never cross a call (always_inline
// into AVX functions). GCC warns at the end of the file, where templates are
// instantiated, so a push/pop around them would not cover it.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace {

// Lane sums of n full words starting at word index `lo0` within one 2^32 run
// whose high-half key is key_hi, one word at a time: the fallback on CPUs
// without AVX2 and the vector loops' remainder.
void hash_run_scalar(const unsigned char* p, int64_t n, uint32_t lo0, uint32_t key_hi, uint32_t* out) {
  uint32_t s0 = 0, s1 = 0;
  uint32_t k = lo0 * RT_FP_KEY_MUL + key_hi;
  for (int64_t j = 0; j < n; ++j) {
    uint32_t w, t0, t1;
    std::memcpy(&w, p + 4 * j, 4);
    rt_fp_word(w, k, &t0, &t1);
    s0 += t0;
    s1 += t1;
    k += RT_FP_KEY_MUL;
  }
  out[0] += s0;
  out[1] += s1;
}

// The vector loop, written once over a register type V (AVX2: 8 words,
// AVX-512: 16) and compiled once per instruction set: the helpers are
// always_inline, so they take the target of the function they land in (a
// plain lambda here would be compiled for the baseline ISA and call every
// intrinsic out of line: 1 GB/s). vpmuludq multiplies the even 32-bit lanes
// into 64-bit products, which land as [lo, hi] in the even and odd 32-bit
// lanes; the odd words and their multipliers are shifted down within their
// 64-bit lanes for a second product. Both products are added with 32-bit
// adds where they land, so the even 32-bit lanes of the accumulator collect
// every word's low half (lane 0) and the odd ones every high half (lane 1),
// with no shuffle: about ten vector operations a block of words.
template <class V>
__attribute__((always_inline)) inline typename V::T block_terms(typename V::T w, typename V::T key,
                                                                 typename V::T mult) {
  const typename V::T x = V::xor_(w, key);
  const typename V::T pe = V::mul_even(x, mult);                            // words 0, 2, ...
  const typename V::T po = V::mul_even(V::srl64(x), V::srl64(mult));  // words 1, 3, ...
  return V::add(pe, po);
}

// Where the loop's software prefetches put the lines it reads 8 KiB ahead.
// Measured side by side from memory (512 MiB, 2 threads, version 2's
// heavier loop): on a Sapphire Rapids-class Xeon, prefetcht1 (to L2) 22.5
// against 20.5 GB/s for prefetcht0 (to L1), where t.sum() read 24.9; on Zen 3
// prefetcht0 is what took the loop from 6.2-7.6 to 9.6-10.4 GB/s a thread.
// Chosen by measurement at run time (fingerprint_lanes_many's prefetch="auto").
enum Prefetch : int { kPrefetchL1 = 0, kPrefetchL2 = 1 };

template <class V, int PF>
__attribute__((always_inline)) inline void hash_run_simd(const unsigned char* p, int64_t n, uint32_t lo0,
                                                          uint32_t key_hi, uint32_t* out) {
  using T = typename V::T;
  constexpr int W = V::kWords;
  const int64_t nvec = n / W;
  uint32_t k_init[W], m_init[W];
  for (int i = 0; i < W; ++i) {
    k_init[i] = (lo0 + (uint32_t)i) * RT_FP_KEY_MUL + key_hi;
    m_init[i] = rt_fp_mult(k_init[i]);
  }
  T k = V::load(k_init), m = V::load(m_init);
  // Keys and multipliers advance by W words a vector (m = 2k + 1 moves twice as fast).
  const T kstep = V::set1((uint32_t)W * RT_FP_KEY_MUL);
  const T mstep = V::add(kstep, kstep);
  T s = V::set1(0), s2 = V::set1(0);
  // Two vectors per iteration, two accumulators: independent chains.
  // Two vectors a step: the keys move by 2 kstep, which is mstep.
  const T kstep2 = mstep, mstep2 = V::add(mstep, mstep);
  T k2 = V::add(k, kstep), m2 = V::add(m, mstep);
  int64_t v = 0;
  for (; v + 2 <= nvec; v += 2) {
    // The hardware prefetcher alone did not keep up with version 2's loop
    // (Zen 3: 6.2-7.6 against 9.6-10.4 GB/s a thread with prefetches 8 KiB
    // ahead); prefetches past the end do not fault.
    for (int c = 0; c < 8 * W; c += 64) __builtin_prefetch(p + 4 * W * v + c + 8192, 0, PF == kPrefetchL1 ? 3 : 2);
    s = V::add(s, block_terms<V>(V::load(p + 4 * W * v), k, m));
    s2 = V::add(s2, block_terms<V>(V::load(p + 4 * W * (v + 1)), k2, m2));
    k = V::add(k, kstep2);
    m = V::add(m, mstep2);
    k2 = V::add(k2, kstep2);
    m2 = V::add(m2, mstep2);
  }
  if (v < nvec) s = V::add(s, block_terms<V>(V::load(p + 4 * W * v), k, m));
  s = V::add(s, s2);
  uint32_t a[W];
  V::store(a, s);
  for (int i = 0; i < W; i += 2) {
    out[0] += a[i];
    out[1] += a[i + 1];
  }
  const int64_t done = nvec * W;
  hash_run_scalar(p + 4 * done, n - done, lo0 + (uint32_t)done, key_hi, out);
}

#ifdef RT_FP_X86
#pragma GCC push_options
#pragma GCC target("avx2")
struct Avx2 {
  using T = __m256i;
  static constexpr int kWords = 8;
  static T load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static void store(void* p, T a) { _mm256_storeu_si256(static_cast<__m256i*>(p), a); }
  static T set1(uint32_t x) { return _mm256_set1_epi32((int)x); }
  static T xor_(T a, T b) { return _mm256_xor_si256(a, b); }
  static T add(T a, T b) { return _mm256_add_epi32(a, b); }
  static T mul_even(T a, T b) { return _mm256_mul_epu32(a, b); }
  static T srl64(T a) { return _mm256_srli_epi64(a, 32); }
};
// Defined here, not as templates, so that each is compiled for this target.
void hash_run_avx2_l1(const unsigned char* p, int64_t n, uint32_t lo0, uint32_t key_hi, uint32_t* out) {
  hash_run_simd<Avx2, kPrefetchL1>(p, n, lo0, key_hi, out);
}
void hash_run_avx2_l2(const unsigned char* p, int64_t n, uint32_t lo0, uint32_t key_hi, uint32_t* out) {
  hash_run_simd<Avx2, kPrefetchL2>(p, n, lo0, key_hi, out);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")
#pragma GCC diagnostic push
// GCC 12's avx512fintrin.h reads an intentionally undefined register in
// _mm512_undefined_epi32 and warns about it under -Wall.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
struct Avx512 {
  using T = __m512i;
  static constexpr int kWords = 16;
  static T load(const void* p) { return _mm512_loadu_si512(p); }
  static void store(void* p, T a) { _mm512_storeu_si512(p, a); }
  static T set1(uint32_t x) { return _mm512_set1_epi32((int)x); }
  static T xor_(T a, T b) { return _mm512_xor_si512(a, b); }
  static T add(T a, T b) { return _mm512_add_epi32(a, b); }
  static T mul_even(T a, T b) { return _mm512_mul_epu32(a, b); }
  static T srl64(T a) { return _mm512_srli_epi64(a, 32); }
};
// Defined here, not as templates, so that each is compiled for this target.
void hash_run_avx512_l1(const unsigned char* p, int64_t n, uint32_t lo0, uint32_t key_hi, uint32_t* out) {
  hash_run_simd<Avx512, kPrefetchL1>(p, n, lo0, key_hi, out);
}
void hash_run_avx512_l2(const unsigned char* p, int64_t n, uint32_t lo0, uint32_t key_hi, uint32_t* out) {
  hash_run_simd<Avx512, kPrefetchL2>(p, n, lo0, key_hi, out);
}
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

using RunFn = void (*)(const unsigned char*, int64_t, uint32_t, uint32_t, uint32_t*);

// The instruction sets this CPU runs, widest first; "scalar" always.
std::vector<std::string> supported_isas() {
  std::vector<std::string> isas;
#ifdef RT_FP_X86
  // __builtin_cpu_supports also checks that the OS saves the wide registers.
  if (__builtin_cpu_supports("avx512f")) isas.push_back("avx512");
  if (__builtin_cpu_supports("avx2")) isas.push_back("avx2");
#endif
  isas.push_back("scalar");
  return isas;
}

const std::vector<std::string>& have_isas() {
  static const std::vector<std::string> have = supported_isas();
  return have;
}

RunFn run_for(const std::string& isa, int prefetch) {
  const std::vector<std::string>& have = have_isas();
  const std::string pick = isa == "auto" ? have.front() : isa;
  TORCH_CHECK(pick == "avx512" || pick == "avx2" || pick == "scalar",
              "fingerprint_lanes_many: isa must be 'auto', 'avx512', 'avx2' or 'scalar', got '", isa, "'");
  TORCH_CHECK(std::find(have.begin(), have.end(), pick) != have.end(), "fingerprint_lanes_many: isa='", pick,
              "' is not supported by this CPU (it runs ", c10::Join(", ", have), ")");
#ifdef RT_FP_X86
  if (pick == "avx512") return prefetch == kPrefetchL2 ? &hash_run_avx512_l2 : &hash_run_avx512_l1;
  if (pick == "avx2") return prefetch == kPrefetchL2 ? &hash_run_avx2_l2 : &hash_run_avx2_l1;
#endif
  return &hash_run_scalar;
}

// The prefetch target prefetch="auto" uses: -1 until a call large enough to
// measure has chosen one, then fixed for the process. The report says what
// was measured.
std::atomic<int> g_prefetch{-1};
std::mutex g_report_mutex;
std::string g_prefetch_report = "not measured yet (no call of at least 64 MiB with prefetch='auto')";

// A call of at least kProbeMinTasks tasks (64 MiB) measures both prefetch
// targets on its own first kProbeTasks tasks, alternating, each task timed on
// its own; the other threads meanwhile stream their tasks as usual, so the
// probe sees the memory system as loaded as the rest of the call. It costs
// nothing: both give the same lanes. Small calls are usually in cache, where
// the target makes no difference and could not be measured.
constexpr int64_t kProbeMinTasks = 256;
constexpr int64_t kProbeTasks = 32;

int parse_prefetch(const std::string& prefetch) {
  TORCH_CHECK(prefetch == "auto" || prefetch == "l1" || prefetch == "l2",
              "fingerprint_lanes_many: prefetch must be 'auto', 'l1' or 'l2', got '", prefetch, "'");
  return prefetch == "l1" ? kPrefetchL1 : prefetch == "l2" ? kPrefetchL2 : -1;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Words [begin, end) of the buffer, global index word_offset + j; split where
// the high half of the global index changes so every run has a fixed key.
void hash_words(RunFn run, const unsigned char* base, int64_t begin, int64_t end, uint64_t word_offset,
                uint32_t* out) {
  int64_t j = begin;
  while (j < end) {
    const uint64_t g = word_offset + (uint64_t)j;
    const uint64_t run_left = (uint64_t{1} << 32) - (g & 0xFFFFFFFFull);
    const int64_t n = (int64_t)std::min<uint64_t>((uint64_t)(end - j), run_left);
    run(base + 4 * j, n, (uint32_t)g, rt_fp_key_hi((uint32_t)(g >> 32)), out);
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
// isa: "auto" (the widest this CPU runs), "avx512", "avx2" or "scalar"; all
// give the same lanes, and the tests run each one the CPU supports.
at::Tensor fingerprint_lanes_many_cpu(at::TensorList datas, at::IntArrayRef word_offsets, c10::string_view isa,
                                      c10::string_view prefetch) {
  const int asked = parse_prefetch(std::string(prefetch));
  int chosen = asked >= 0 ? asked : g_prefetch.load();
  // Check the ISA before any work (either target gives the same error).
  run_for(std::string(isa), kPrefetchL1);
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
  const int64_t ntasks = (int64_t)tasks.size();
  const bool probe = chosen < 0 && ntasks >= kProbeMinTasks && std::string(isa) != "scalar";
  // Until a probe has chosen, prefetch="auto" reads into L1 (prefetcht0).
  const RunFn run_l1 = run_for(std::string(isa), kPrefetchL1), run_l2 = run_for(std::string(isa), kPrefetchL2);
  const RunFn run = chosen == kPrefetchL2 ? run_l2 : run_l1;
  std::vector<double> probe_ns(probe ? kProbeTasks : 0, 0.0);
  at::parallel_for(0, ntasks, 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const Task& t = tasks[k];
      const unsigned char* base = datas[t.tensor].const_data_ptr<uint8_t>();
      if (probe && k < kProbeTasks) {
        const auto t0 = std::chrono::steady_clock::now();
        hash_words(k % 2 ? run_l2 : run_l1, base, t.begin, t.end, (uint64_t)word_offsets[t.tensor], &acc[2 * k]);
        probe_ns[k] = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
                      (double)(t.end - t.begin);
      } else {
        hash_words(run, base, t.begin, t.end, (uint64_t)word_offsets[t.tensor], &acc[2 * k]);
      }
    }
  });
  if (probe) {
    std::vector<double> l1, l2;
    for (int64_t k = 0; k < kProbeTasks; ++k) (k % 2 ? l2 : l1).push_back(probe_ns[k]);
    const double m1 = median(l1), m2 = median(l2);
    int expected = -1;
    if (g_prefetch.compare_exchange_strong(expected, m2 < m1 ? kPrefetchL2 : kPrefetchL1)) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "measured on %lld tasks of 256 KiB: l1 %.1f GB/s, l2 %.1f GB/s a thread",
                    (long long)kProbeTasks, 4.0 / m1, 4.0 / m2);
      std::lock_guard<std::mutex> lock(g_report_mutex);
      g_prefetch_report = buf;
    }
  }
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
      uint32_t t0, t1;
      rt_fp_word(w, (uint32_t)g * RT_FP_KEY_MUL + rt_fp_key_hi((uint32_t)(g >> 32)), &t0, &t1);
      sums[2 * i] += t0;
      sums[2 * i + 1] += t1;
    }
    o[2 * i] = (int64_t)sums[2 * i];
    o[2 * i + 1] = (int64_t)sums[2 * i + 1];
  }
  return out;
}

at::Tensor fingerprint_lanes_cpu(const at::Tensor& data, int64_t word_offset) {
  check_data(data);
  return fingerprint_lanes_many_cpu({data}, {word_offset}, "auto", "auto").reshape({2});
}

// The instruction sets fingerprint_lanes_many accepts on this CPU, widest
// first, comma-separated ("auto" picks the first).
std::string fingerprint_cpu_isas() { return c10::Join(",", have_isas()); }

// What impl="cpu" runs with isa="auto" and prefetch="auto": the instruction
// set, the prefetch target ("l1", "l2", or "unset" before a probe), and what
// the probe measured.
std::string fingerprint_cpu_choice() {
  const int p = g_prefetch.load();
  std::lock_guard<std::mutex> lock(g_report_mutex);
  return have_isas().front() + ", prefetch " + (p == kPrefetchL2 ? "l2" : p == kPrefetchL1 ? "l1" : "unset") +
         " (" + g_prefetch_report + ")";
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(resident_trainer, m) {
  m.def("fingerprint_lanes(Tensor data, int word_offset) -> Tensor");
  m.def(
      "fingerprint_lanes_many(Tensor[] datas, int[] word_offsets, str isa=\"auto\", str prefetch=\"auto\") -> "
      "Tensor");
  m.def("fingerprint_cpu_isas() -> str", &fingerprint_cpu_isas);
  m.def("fingerprint_cpu_choice() -> str", &fingerprint_cpu_choice);
}

TORCH_LIBRARY_IMPL(resident_trainer, CPU, m) {
  m.impl("fingerprint_lanes", &fingerprint_lanes_cpu);
  m.impl("fingerprint_lanes_many", &fingerprint_lanes_many_cpu);
}
