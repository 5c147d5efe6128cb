// Device-side pieces of the compact block coder (docs/compact-format.md), mirroring
// host/codec/compact_codec_block.cpp function by function (the value symbols and the rANS symbol
// arithmetic are the CPU's own, codec/compact_symbols.hpp): hybrid-integer tokens,
// the deterministic table quantization, varints and little-endian byte access. Everything
// works on bytes (no wide loads or stores), because payloads, records and value arrays have no
// alignment guarantee. Shared by the encode and decode kernels.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "codec/compact_block_index.hpp"
#include "codec/compact_symbols.hpp"

namespace deltasync::cuda::detail::compact_coder {

// Shared with the CPU codec (codec/compact_symbols.hpp, codec/compact_block_index.hpp).
using compact::apply_value_symbol;
using compact::enc_symbol;
using compact::EncSymbol;
using compact::from_ordered;
using compact::kRansLow;
using compact::kScale;
using compact::kScaleBits;
using compact::to_ordered;
using compact::value_symbol;
using compact::width_mask;
inline constexpr uint32_t kGapTokens = 256;     // tokens of 64-bit integers
inline constexpr uint32_t kMaxValueTokens = 128;  // value tokens of 4-byte elements
inline constexpr uint32_t kIndexHeaderBytes = compact::kIndexHeaderBytes;
inline constexpr uint32_t kRecordBytes = compact::kRecordBytes;
// Largest encoded size of both frequency tables: num_symbols (<= 256: 2 varint bytes) and
// frequencies (<= 4096: 2 bytes each) for 256 gap and 128 value symbols.
inline constexpr uint32_t kMaxTableBytes = 2 + 2 * kGapTokens + 2 + 2 * kMaxValueTokens;

// ---- hybrid integers ------------------------------------------------------------------------

struct Token {
  uint32_t token;
  uint32_t extra_bits;  // the raw bits are the low extra_bits bits of the integer
};
__host__ __device__ inline uint32_t floor_log2(uint64_t v) {  // v >= 1
#ifdef __CUDA_ARCH__
  return 63u - static_cast<uint32_t>(__clzll(static_cast<long long>(v)));
#else
  return 63u - static_cast<uint32_t>(__builtin_clzll(v));
#endif
}
__host__ __device__ inline Token tokenize(uint64_t v) {
  if (v < 16) return {static_cast<uint32_t>(v), 0};
  const uint32_t n = floor_log2(v);
  return {16u + 4u * (n - 4u) + (static_cast<uint32_t>(v >> (n - 2)) & 3u), n - 2u};
}
// Inverse view: a token's integer is token_base + (token_extra_bits raw bits).
__host__ __device__ inline uint64_t token_base(uint32_t token) {
  if (token < 16) return token;
  const uint32_t n = (token - 16) / 4 + 4;
  return uint64_t{4u | ((token - 16) & 3u)} << (n - 2);
}
__host__ __device__ inline uint32_t token_extra_bits(uint32_t token) { return token < 16 ? 0 : (token - 16) / 4 + 2; }
// Value tokens of a width are below this (its symbols are < 2^(8*width)): 32, 64, 128.
__host__ __device__ inline uint32_t value_token_limit(uint32_t width) { return tokenize(width_mask(width)).token + 1; }
__host__ __device__ inline uint64_t low_bits(uint64_t v, uint32_t n) { return n >= 64 ? v : v & ((uint64_t{1} << n) - 1); }

// ---- little-endian bytes --------------------------------------------------------------------

__host__ __device__ inline uint32_t load_bits(const uint8_t* p, uint32_t width) {
  uint32_t v = 0;
  for (uint32_t k = 0; k < width; ++k) v |= static_cast<uint32_t>(p[k]) << (8 * k);
  return v;
}
__host__ __device__ inline void store_bits(uint8_t* p, uint32_t v, uint32_t width) {
  for (uint32_t k = 0; k < width; ++k) p[k] = static_cast<uint8_t>(v >> (8 * k));
}
__host__ __device__ inline void store_u32(uint8_t* p, uint32_t v) { store_bits(p, v, 4); }
__host__ __device__ inline void store_u64(uint8_t* p, uint64_t v) {
  store_u32(p, static_cast<uint32_t>(v));
  store_u32(p + 4, static_cast<uint32_t>(v >> 32));
}

// ---- frequency tables -----------------------------------------------------------------------

// Quantizes counts[0, limit) to frequencies summing to kScale, exactly like the CPU's
// normalize(): f = max(1, round(count * kScale / total)); a shortfall goes to the first symbol
// of largest f; an excess is taken repeatedly from the first symbol of largest f, at most half
// of it at a time. Returns num_symbols (0 for an empty histogram); freq and start are filled
// for [0, num_symbols).
__device__ inline uint32_t normalize(const uint32_t* counts, uint32_t limit, uint32_t* freq, uint32_t* start) {
  uint64_t total = 0;
  uint32_t num_symbols = 0;
  for (uint32_t s = 0; s < limit; ++s) {
    total += counts[s];
    if (counts[s] != 0) num_symbols = s + 1;
  }
  if (total == 0) return 0;
  for (uint32_t s = 0; s < num_symbols; ++s) freq[s] = 0;
  int64_t sum = 0;
  uint32_t largest = 0;
  for (uint32_t s = 0; s < num_symbols; ++s) {
    if (counts[s] == 0) continue;
    const uint64_t f = (uint64_t{counts[s]} * kScale + total / 2) / total;
    freq[s] = static_cast<uint32_t>(f > 1 ? f : 1);
    sum += freq[s];
    if (freq[s] > freq[largest]) largest = s;
  }
  if (sum < kScale) {
    freq[largest] += static_cast<uint32_t>(kScale - sum);
  } else {
    while (sum > kScale) {
      uint32_t best = 0;
      for (uint32_t s = 0; s < num_symbols; ++s)
        if (freq[s] > freq[best]) best = s;
      const int64_t half = freq[best] / 2;
      const int64_t excess = sum - kScale;
      const uint32_t take = static_cast<uint32_t>(excess < half ? excess : half);
      const uint32_t step = take > 1 ? take : 1;
      freq[best] -= step;
      sum -= step;
    }
  }
  uint32_t acc = 0;
  for (uint32_t s = 0; s < num_symbols; ++s) {
    start[s] = acc;
    acc += freq[s];
  }
  return num_symbols;
}

__device__ inline uint32_t put_varint(uint8_t* out, uint32_t v) {
  uint32_t n = 0;
  while (v >= 0x80) {
    out[n++] = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  out[n++] = static_cast<uint8_t>(v);
  return n;
}

}  // namespace deltasync::cuda::detail::compact_coder
