// The block coder's per-change passes (compact_codec_block.cpp) sixteen changes at a time with
// AVX-512: the encoder's tokens and raw bits, the decoder's raw bits, positions and value
// symbols. The scalar loops of the block coder are the reference; these compute the same
// integers with lane-wise arithmetic, because the scalar passes spend ~35 instructions per
// change and are bound by how many the core issues, not by a dependency chain (the encoder's
// pass took ~10 cycles per change here, the decoder's ~2.5 times its rANS step).
// Compiled for AVX-512 in compact_block_simd.cpp only and taken when simd_blocks_supported().
#pragma once
#include <cstdint>

namespace deltasync::compact::detail {

inline constexpr uint32_t kSimdGroup = 16;     // changes per step
inline constexpr uint32_t kQuadChanges = 4;    // changes whose raw bits the encoder writes as one integer
inline constexpr uint8_t kQuadTooWide = 0xFF;  // quad_bits of a quad the caller codes change by change
inline constexpr uint32_t kMaxSimdRawBits = 56;  // raw bits of a change (or a quad) the SIMD passes handle

// Whether this CPU runs these passes (AVX-512 F, BW, VL, CD, DQ) and DELTASYNC_CODEC_SIMD does
// not ask for another level (compact_word_lanes.hpp: word_simd_level). Checked once.
bool simd_blocks_supported();

// ---- encoder ----------------------------------------------------------------------------------

// Changes [first, first + 16 * groups) of a block, first >= 1 (change 0 has no gap), positions
// ascending, values `width` bytes (1, 2 or 4): change i's gap token into gap_tokens[i] and its
// value token into value_tokens[i]. Quad q (changes first + 4q .. first + 4q + 3): their raw bits
// in decode order (per change the gap's, then the value's) as one integer quad_raw[q] of
// quad_bits[q] <= 56 bits, or quad_bits[q] = kQuadTooWide when they need more (or a gap of the
// group is 2^32 or more): the caller then codes those four changes one by one, tokens included.
// quad_bits has 4 bytes of slack after the last quad.
void tokenize_groups(const int64_t* positions, const uint8_t* new_bits, const uint8_t* base_bits, uint32_t width,
                     uint32_t first, uint32_t groups, uint8_t* gap_tokens, uint8_t* value_tokens, uint64_t* quad_raw,
                     uint8_t* quad_bits);

// ---- decoder ----------------------------------------------------------------------------------

// Sixteen changes after `position` from their tokens (gap_tokens[k], value_tokens[k], none the
// block's first change), their raw bits read from bit `bit_at` of `bits` (which must be readable
// 8 bytes past the last raw bit the group reads -- the decoder's padded copy): positions[k] =
// previous position + 1 + gap, and the value symbols, `width` bytes each, into symbols. Advances
// bit_at and position. Returns false, writing and advancing nothing, when the group is for the
// scalar loop: a gap of 2^32 or more, a change with more than 56 raw bits, or a position at or
// past `numel` (which the scalar loop then reports, as it would have).
bool decode_raw_group(const uint8_t* gap_tokens, const uint8_t* value_tokens, const uint8_t* bits, uint64_t& bit_at,
                      uint64_t& position, uint64_t numel, uint32_t width, int64_t* positions, uint8_t* symbols);

}  // namespace deltasync::compact::detail
