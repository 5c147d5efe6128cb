// The integer arithmetic of the compact format's symbols (docs/compact-format.md), written once
// for the CPU codec and its GPU twin: under nvcc these are __host__ __device__ functions.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define DELTASYNC_HOST_DEVICE __host__ __device__
#else
#define DELTASYNC_HOST_DEVICE
#endif

namespace deltasync::compact {

// rANS: 12-bit frequencies, 32-bit states renormalized byte-wise within [kRansLow, kRansLow << 8).
inline constexpr uint32_t kScaleBits = 12;
inline constexpr uint32_t kScale = 1u << kScaleBits;
inline constexpr uint32_t kRansLow = 1u << 23;

// The value symbol of one change: the difference new - base of the elements' ORDERED bit
// patterns (an integer order in which floats sort numerically: sign set -> ~bits, else
// bits | sign), modulo 2^(8*width), zigzagged so that +1 -> 2, -1 -> 1. A ±1-ulp step is
// therefore 1 or 2 whatever the sign or exponent. Exposed for tests and entropy measurements.
DELTASYNC_HOST_DEVICE inline uint32_t width_mask(uint32_t width) { return width >= 4 ? 0xFFFFFFFFu : (1u << (8 * width)) - 1u; }
// Written without conditionals: the sign of a changed weight is a coin flip, and compilers turn
// `sign ? a : b` into a branch that mispredicts on half of all changes.
DELTASYNC_HOST_DEVICE inline uint32_t to_ordered(uint32_t bits, uint32_t width) {
  const uint32_t sign = 1u << (8 * width - 1);
  const uint32_t negative = 0u - ((bits >> (8 * width - 1)) & 1u);  // all ones iff the sign bit is set
  return bits ^ ((negative & width_mask(width)) | sign);  // negative: ~bits & mask; else bits | sign
}
DELTASYNC_HOST_DEVICE inline uint32_t from_ordered(uint32_t ordered, uint32_t width) {
  const uint32_t sign = 1u << (8 * width - 1);
  const uint32_t was_negative = ((ordered >> (8 * width - 1)) & 1u) - 1u;  // all ones iff the top bit is clear
  return ordered ^ ((was_negative & width_mask(width)) | sign);
}
DELTASYNC_HOST_DEVICE inline uint32_t value_symbol(uint32_t new_bits, uint32_t base_bits, uint32_t width) {
  const uint32_t mask = width_mask(width);
  const uint32_t diff = (to_ordered(new_bits, width) - to_ordered(base_bits, width)) & mask;
  const uint32_t negative = 0u - ((diff >> (8 * width - 1)) & 1u);
  return ((diff << 1) ^ negative) & mask;
}
DELTASYNC_HOST_DEVICE inline uint32_t apply_value_symbol(uint32_t symbol, uint32_t base_bits, uint32_t width) {
  const uint32_t mask = width_mask(width);
  const uint32_t diff = ((symbol >> 1) ^ (0u - (symbol & 1u))) & mask;
  return from_ordered((to_ordered(base_bits, width) + diff) & mask, width);
}
// New bits decoded against `decoded_base` (e.g. zeros, or the bits at another position) moved
// onto `base_bits`: the ordered difference they carry is kept.
DELTASYNC_HOST_DEVICE inline uint32_t rebase_value(uint32_t new_bits, uint32_t decoded_base, uint32_t base_bits, uint32_t width) {
  const uint32_t diff = to_ordered(new_bits, width) - to_ordered(decoded_base, width);
  return from_ordered((to_ordered(base_bits, width) + diff) & width_mask(width), width);
}

// Encoder view of one symbol: division by the frequency replaced by a multiply with a
// precomputed reciprocal (exact for states below 2^31, which the byte-wise renormalization
// guarantees), as in the classic "rans_byte" formulation.
// 32 bytes, so that indexing by token is one shift. A plain aggregate (no initializers), so
// that the GPU encoder can hold a table of them in shared memory.
struct alignas(32) EncSymbol {
  uint32_t x_max;      // emit one byte if x >= x_max
  uint32_t x_max2;     // emit two if x >= x_max2 (x_max << 8, saturated: x < 2^31 never reaches it)
  uint32_t rcp_freq;   // ceil(2^(shift+31) / freq)
  uint32_t bias;
  uint32_t cmpl_freq;  // kScale - freq
  uint32_t rcp_shift;  // 32 + the reciprocal's extra shift
};

DELTASYNC_HOST_DEVICE inline EncSymbol enc_symbol(uint32_t start, uint32_t freq) {
  EncSymbol e{};
  e.x_max = ((kRansLow >> kScaleBits) << 8) * freq;
  const uint64_t x_max2 = uint64_t{e.x_max} << 8;
  e.x_max2 = x_max2 < 0xFFFFFFFFu ? static_cast<uint32_t>(x_max2) : 0xFFFFFFFFu;
  e.cmpl_freq = kScale - freq;
  if (freq < 2) {
    // q = x·(2^32-1) >> 32 = x - 1, and x + (start + kScale - 1) + (x - 1)(kScale - 1) = x·kScale + start.
    e.rcp_freq = ~0u;
    e.rcp_shift = 32;
    e.bias = start + kScale - 1;
  } else {
    uint32_t shift = 0;
    while (freq > (1u << shift)) ++shift;
    e.rcp_freq = static_cast<uint32_t>(((uint64_t{1} << (shift + 31)) + freq - 1) / freq);
    e.rcp_shift = 32 + shift - 1;
    e.bias = start;
  }
  return e;
}

// ---- compact_version 2: 32 interleaved lanes, 16-bit renormalization --------------------------
//
// Change i of a block codes its tokens in lane i mod 32; all lanes share one stream of 16-bit
// little-endian words, read in the decode order (per group of 32 changes: the gap round, lanes
// ascending, then the value round). A state lives in [kWordRansLow, kWordRansLow << 16), so a
// decode step needs at most one word (htscodecs' "rans32x16" arrangement with 12-bit
// frequencies): a warp or a SIMD register decodes 32 tokens per step without a serial byte loop.
inline constexpr uint32_t kWordLanes = 32;
inline constexpr uint32_t kWordRansLow = 1u << 15;

// The word-wise encoder symbol: the byte-wise one with the renormalization bound for 16-bit
// words, x_max = ((kWordRansLow >> kScaleBits) << 16) * freq (at most 2^31; x_max2 unused).
// The reciprocal stays exact: states stay below 2^31.
DELTASYNC_HOST_DEVICE inline EncSymbol enc_word_symbol(uint32_t start, uint32_t freq) {
  EncSymbol e = enc_symbol(start, freq);
  e.x_max = ((kWordRansLow >> kScaleBits) << 16) * freq;
  e.x_max2 = 0xFFFFFFFFu;
  return e;
}

// The decoder's slot entry of the word-wise coder, one 32-bit word per slot so that a SIMD
// gather or one shared-memory load serves a lane: (freq - 1) | (slot - start) << 12 | symbol << 24.
DELTASYNC_HOST_DEVICE inline uint32_t word_slot_entry(uint32_t freq, uint32_t offset, uint32_t symbol) {
  return (freq - 1) | offset << 12 | symbol << 24;
}
DELTASYNC_HOST_DEVICE inline uint32_t word_slot_symbol(uint32_t entry) { return entry >> 24; }
// x -> freq * (x >> 12) + (slot - start): the state after decoding the slot's symbol.
DELTASYNC_HOST_DEVICE inline uint32_t word_rans_advance(uint32_t x, uint32_t entry) {
  return ((entry & (kScale - 1)) + 1) * (x >> kScaleBits) + ((entry >> kScaleBits) & (kScale - 1));
}

}  // namespace deltasync::compact
