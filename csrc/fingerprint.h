// Fingerprint mixer and constants, shared by the C++ CPU and CUDA kernels.
//
// Digest of a byte string B (a tensor's row-major contents) hashed as a shard
// starting at global 32-bit word index `word_offset`:
//   w[i]   = little-endian uint32 of bytes 4i..4i+3 of B, zero-padded at the end
//   g      = word_offset + i                (64-bit: no wrap above 16 GiB)
//   lane0 += fmix32(w[i] ^ (lo(g) * KEY0_MUL + fmix32(hi(g) ^ HI_SEED0)))
//   lane1 += lowbias32(w[i] + (lo(g) * KEY1_MUL + lowbias32(hi(g) ^ HI_SEED1)))
// with all arithmetic mod 2^32. Each term is a bijection of w[i] for a fixed
// position, so one changed word always changes both lane sums, and sums are
// order-free: any tiling, grid or thread count gives the same lanes, and
// shards combine by adding their lanes. The Python layer finalizes the two
// lanes with numel, dtype and shape into the 64-bit digest.
//
// triton_kernels/fingerprint.py and the numpy oracle in
// resident_trainer/ops/fingerprint.py restate these constants; a test parses
// this header and checks that all three agree.
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define RT_FP_INLINE __host__ __device__ __forceinline__
#else
#define RT_FP_INLINE static inline
#endif

#define RT_FP_KEY0_MUL 0x9E3779B1u
#define RT_FP_KEY1_MUL 0x85EBCA77u
#define RT_FP_HI_SEED0 0x27D4EB2Fu
#define RT_FP_HI_SEED1 0x165667B1u

// murmur3 finalizer: invertible, full avalanche.
RT_FP_INLINE uint32_t rt_fp_fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// "lowbias32" (C. Wellons' hash prospector): invertible, lower bias than
// fmix32, and different multipliers so the two lanes fail independently.
RT_FP_INLINE uint32_t rt_fp_lowbias32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  h ^= h >> 16;
  return h;
}

// Per-run key of the high 32 bits of the word index (constant over 2^32 words).
RT_FP_INLINE uint32_t rt_fp_key0_hi(uint32_t hi) { return rt_fp_fmix32(hi ^ RT_FP_HI_SEED0); }
RT_FP_INLINE uint32_t rt_fp_key1_hi(uint32_t hi) { return rt_fp_lowbias32(hi ^ RT_FP_HI_SEED1); }

RT_FP_INLINE uint32_t rt_fp_lane0(uint32_t w, uint32_t lo, uint32_t key0_hi) {
  return rt_fp_fmix32(w ^ (lo * RT_FP_KEY0_MUL + key0_hi));
}

RT_FP_INLINE uint32_t rt_fp_lane1(uint32_t w, uint32_t lo, uint32_t key1_hi) {
  return rt_fp_lowbias32(w + (lo * RT_FP_KEY1_MUL + key1_hi));
}

// Little-endian word from the last 1..3 bytes of a buffer, zero-padded.
RT_FP_INLINE uint32_t rt_fp_tail_word(const unsigned char* p, int64_t n) {
  uint32_t w = 0;
  for (int64_t k = 0; k < n; ++k) w |= (uint32_t)p[k] << (8 * k);
  return w;
}
