// Fingerprint mixer and constants (definition version 2), shared by the C++
// CPU and CUDA kernels.
//
// Lane sums of a byte string B (a tensor's row-major contents) hashed as a
// shard starting at global 32-bit word index `word_offset`:
//   w[i]  = little-endian uint32 of bytes 4i..4i+3 of B, zero-padded at the end
//   g     = word_offset + i              (64-bit: no wrap above 16 GiB)
//   k     = lo(g) * KEY_MUL + mum(hi(g) ^ HI_SEED, HI_MUL)
//   two Feistel rounds on the halves (L, R) = (k, w ^ k):
//     (L, R) -> (R, L ^ mum(R, MIXr_MUL)),  r = 0, 1
//   lane0 += L + rotl(R, 16), lane1 += R    (mod 2^32 each)
// where mum(a, m) = lo32(a * m) ^ hi32(a * m) of the exact 64-bit product.
// A Feistel round is a bijection of (L, R) whatever its round function, and
// so is (L, R) -> (L + rotl(R, 16), R); for a fixed position
// w -> (lane0 term, lane1 term) is therefore injective: one changed word
// always changes the lane pair. Sums are order-free: any tiling, grid or
// thread count gives the same lanes, and shards combine by adding their lanes.
// The only multiplies are 32x32->64 (vpmuludq on x86, one IMAD.WIDE.U32 on
// NVIDIA), one micro-op on Intel and AMD cores alike, where the version-1
// mixers' four 32-bit multiplies per word (vpmulld) are two micro-ops of ten
// cycles' latency each on Intel cores. The Python layer finalizes the two lanes with numel, dtype and shape
// into the 64-bit digest.
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

#define RT_FP_VERSION 2

#define RT_FP_KEY_MUL 0x9E3779B1u
#define RT_FP_HI_SEED 0x27D4EB2Fu
#define RT_FP_HI_MUL 0x165667B1u
#define RT_FP_MIX0_MUL 0xC2B2AE3Du
#define RT_FP_MIX1_MUL 0x7FEB352Du

// Fold of the exact 64-bit product: both halves, so every input bit reaches
// every output bit's neighbourhood (the low half alone never moves bits down).
RT_FP_INLINE uint32_t rt_fp_mum(uint32_t a, uint32_t m) {
  const uint64_t p = (uint64_t)a * m;
  return (uint32_t)p ^ (uint32_t)(p >> 32);
}

// Key of the high 32 bits of the word index (constant over 2^32 words).
RT_FP_INLINE uint32_t rt_fp_key_hi(uint32_t hi) { return rt_fp_mum(hi ^ RT_FP_HI_SEED, RT_FP_HI_MUL); }

RT_FP_INLINE uint32_t rt_fp_rotl16(uint32_t x) { return (x << 16) | (x >> 16); }

// The two lane terms of word w under position key k. After two rounds L has
// passed through one product only: summed as is, two words' single-bit
// changes cancel in an 8-bit window of both lanes 4 to 8 times as often as
// uniform terms would (measured); adding the rotated R to it brings that to
// uniform, as a third round does, for one operation instead of eight.
RT_FP_INLINE void rt_fp_word(uint32_t w, uint32_t k, uint32_t* t0, uint32_t* t1) {
  const uint32_t x = w ^ k;
  const uint32_t l = k ^ rt_fp_mum(x, RT_FP_MIX0_MUL);
  const uint32_t r = x ^ rt_fp_mum(l, RT_FP_MIX1_MUL);
  *t0 = l + rt_fp_rotl16(r);
  *t1 = r;
}

// Little-endian word from the last 1..3 bytes of a buffer, zero-padded.
RT_FP_INLINE uint32_t rt_fp_tail_word(const unsigned char* p, int64_t n) {
  uint32_t w = 0;
  for (int64_t k = 0; k < n; ++k) w |= (uint32_t)p[k] << (8 * k);
  return w;
}
