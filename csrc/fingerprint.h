// Fingerprint word terms and constants (definition version 3), shared by
// the C++ CPU and CUDA kernels.
//
// Lane sums of a byte string B (a tensor's row-major contents) hashed as a
// shard starting at global 32-bit word index `word_offset`:
//   w[i]  = little-endian uint32 of bytes 4i..4i+3 of B, zero-padded at the end
//   g     = word_offset + i              (64-bit: no wrap above 16 GiB)
//   k     = lo(g) * KEY_MUL + mum(hi(g) ^ HI_SEED, HI_MUL)   (mod 2^32)
//   m     = 2k + 1                       (odd, mod 2^32)
//   p     = (w ^ k) * m                  (the exact 64-bit product)
//   lane0 += lo32(p), lane1 += hi32(p)   (mod 2^32 each)
// where mum(a, m) = lo32(a * m) ^ hi32(a * m) of the exact 64-bit product.
// For a fixed position, w -> p is injective (w ^ k is a bijection, and an
// exact product by a nonzero m determines its factor), and (lane0 term,
// lane1 term) is p itself: one changed word always changes the lane pair.
// Sums are order-free: any tiling, grid or thread count gives the same
// lanes, and shards combine by adding their lanes. The only multiply is one
// 32x32->64 per word (vpmuludq on x86, one micro-op on Intel and AMD cores
// alike; IMAD.WIDE.U32 on NVIDIA), and both halves of the product are summed
// where they land, so a vector loop spends about ten operations on eight or
// sixteen words (version 2's two product folds per word took about 22:
// bound by arithmetic on AVX2 cores that split 256-bit operations). The
// Python layer finalizes the two lanes with numel, dtype and shape into the
// 64-bit digest.
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

#define RT_FP_VERSION 3

#define RT_FP_KEY_MUL 0x9E3779B1u
#define RT_FP_HI_SEED 0x27D4EB2Fu
#define RT_FP_HI_MUL 0x165667B1u

// Fold of the exact 64-bit product (the high half's key, once per 2^32 words).
RT_FP_INLINE uint32_t rt_fp_mum(uint32_t a, uint32_t m) {
  const uint64_t p = (uint64_t)a * m;
  return (uint32_t)p ^ (uint32_t)(p >> 32);
}

// Key of the high 32 bits of the word index (constant over 2^32 words).
RT_FP_INLINE uint32_t rt_fp_key_hi(uint32_t hi) { return rt_fp_mum(hi ^ RT_FP_HI_SEED, RT_FP_HI_MUL); }

// The multiplier of the word at key k: odd, so never zero, and distinct for
// positions less than 2^31 words apart within a 2^32-word run.
RT_FP_INLINE uint32_t rt_fp_mult(uint32_t k) { return 2u * k + 1u; }

// The two lane terms of word w under position key k: the halves of the exact
// product (w ^ k) * (2k + 1).
RT_FP_INLINE void rt_fp_word(uint32_t w, uint32_t k, uint32_t* t0, uint32_t* t1) {
  const uint64_t p = (uint64_t)(w ^ k) * rt_fp_mult(k);
  *t0 = (uint32_t)p;
  *t1 = (uint32_t)(p >> 32);
}

// Little-endian word from the last 1..3 bytes of a buffer, zero-padded.
RT_FP_INLINE uint32_t rt_fp_tail_word(const unsigned char* p, int64_t n) {
  uint32_t w = 0;
  for (int64_t k = 0; k < n; ++k) w |= (uint32_t)p[k] << (8 * k);
  return w;
}
