// The per-element term of deltasync's tensor digest, shared verbatim by the CPU code and the
// CUDA kernels (DELTASYNC_HD marks it __host__ __device__ under nvcc), so both backends compute
// the same 64-bit value by construction.
//
// Definition (version 1, "sum-mix64-v1"): for a tensor of `width`-byte elements (1, 2 or 4),
//
//   D = Σ_i term(i, bits_i)  mod 2^64,   term(i, b) = mix64(((i mod 2^32) << 32 | b) ^ seed(width, i >> 32))
//
// where bits_i is the element's raw little-endian bit pattern (so -0.0 != +0.0 and every NaN
// payload counts), mix64 is the splitmix64 finalizer and seed() is mix64 of the 2^32-element
// block number and the width. Why this shape:
// - a sum mod 2^64 does not depend on the order or grouping of the terms, so any chunking, any
//   thread count and a GPU reduction with atomics all give the same bits;
// - a delta changes the digest by Σ term(i, new) - term(i, old) over its changed elements only,
//   which is what makes verification O(changed);
// - for a fixed position the key (i mod 2^32, b) -> term is injective (mix64 is a bijection), so a
//   change of any single element always changes the digest; changes of several elements go
//   unnoticed with probability about 2^-64;
// - positions beyond 2^32 move into the seed rather than being dropped, and the width is folded
//   into the seed so that identical bytes read as different dtypes give different digests.
// Changing anything here changes every recorded digest: bump kDigestAlgorithm in integrity.hpp.
#pragma once
#include <cstdint>

#ifndef DELTASYNC_HD
#if defined(__CUDACC__)
#define DELTASYNC_HD __host__ __device__
#else
#define DELTASYNC_HD
#endif
#endif

namespace deltasync::digest_mix {

// Positions are split into 2^32-element blocks: the offset inside the block goes into the key,
// the block number into the seed. Chunks of work must not straddle a block boundary.
inline constexpr unsigned kBlockShift = 32;
inline constexpr uint64_t kBlockElements = uint64_t{1} << kBlockShift;

// splitmix64's output finalizer (Stafford's Mix13): a bijection on 64 bits with full avalanche.
DELTASYNC_HD inline constexpr uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

// Seed of block `block` (= position >> 32) of a tensor of `width`-byte elements.
DELTASYNC_HD inline constexpr uint64_t block_seed(uint32_t width, uint64_t block) {
  return mix64((block + 1) * 0x9E3779B97F4A7C15ull ^ uint64_t{width} * 0xD1B54A32D192ED03ull);
}

// Term of one element: `position` is its flat index (only the low 32 bits are used here; the
// rest is in `seed`), `bits` its raw bit pattern zero-extended.
DELTASYNC_HD inline constexpr uint64_t term(uint64_t seed, uint64_t position, uint32_t bits) {
  return mix64(((position << 32) | bits) ^ seed);
}

// Term of one element when the seed is not at hand (scattered positions).
DELTASYNC_HD inline constexpr uint64_t term_at(uint32_t width, uint64_t position, uint32_t bits) {
  return term(block_seed(width, position >> kBlockShift), position, bits);
}

}  // namespace deltasync::digest_mix
