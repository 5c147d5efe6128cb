// Private to the compact codec: the rANS stream of a compact_version 2 block -- 32 interleaved
// lanes sharing one stream of 16-bit words (docs/compact-format.md, "rANS stream, version 2").
// The block coder (compact_codec_block.cpp) owns tokens, raw bits and positions; this file only
// turns token sequences into the stream and back.
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>

#include "codec/compact_symbols.hpp"
#include "core/little_endian.hpp"

namespace deltasync::compact::detail {

inline constexpr uint32_t kWordStateBytes = 4 * kWordLanes;  // the 32 final encoder states
// Bytes a decoder may read past its stream's last word in one group: 64 words, plus the
// 32-byte SIMD load at the last of them (AVX-512; AVX2 loads 16).
inline constexpr size_t kWordStreamPad = 2 * 2 * kWordLanes + 64;

// A decoder slot table of the word-wise coder (word_slot_entry per slot), 16 KiB.
struct alignas(64) WordSlotTable {
  std::array<uint32_t, kScale> entry;
};

// ---- encoder ----------------------------------------------------------------------------

// One encode step of a lane; the word is stored unconditionally and the pointer moves by 0 or
// 2 bytes (whether a lane emits is a coin flip: no branch). Stores below the final pointer are
// overwritten or ignored, so the buffer needs 2 bytes of slack in front.
inline void put_word(uint32_t& x, uint8_t*& ptr, const EncSymbol& e) {
  const uint32_t k = static_cast<uint32_t>(x >= e.x_max);
  ::deltasync::detail::store_le<uint16_t>(ptr - 2, static_cast<uint16_t>(x));
  ptr -= 2 * k;
  x >>= 16 * k;
  const uint32_t q = static_cast<uint32_t>((static_cast<uint64_t>(x) * e.rcp_freq) >> e.rcp_shift);
  x += e.bias + q * e.cmpl_freq;
}

// Codes change i's gap token (i >= 1) and value token in lane i mod 32, in reverse decode order,
// writing backwards from `end`; returns the stream's first byte (the 32 final states, lane 0
// first, then the words). `end` needs 4 * count + kWordStateBytes + 2 bytes in front of it.
// gap_enc and value_enc have 256 entries each (unused tokens' entries initialized too).
// An encoder symbol packed into 64 bits for the SIMD encoder (one gather per lane instead of
// five): rcp_freq | (freq | bias << 13 | (rcp_shift - 32) << 26) << 32. freq <= 4096 and
// bias <= start + 4095 < 8192 fit 13 bits, rcp_shift - 32 <= 11 fits 4.
inline uint64_t pack_word_symbol(const EncSymbol& e) {
  const uint32_t freq = kScale - e.cmpl_freq;
  return uint64_t{e.rcp_freq} | uint64_t{freq | e.bias << 13 | (e.rcp_shift - 32) << 26} << 32;
}

// The SIMD paths of the word-wise coder, chosen at run time: each runs a full group of 32
// changes (not a block's first) with the same arithmetic and bytes as the scalar reference
// (put_word / word_round), 16 lanes per instruction with AVX-512 (F, BW, VL), 8 with AVX2.
enum class WordSimd : uint8_t { kScalar, kAvx2, kAvx512 };
// Whether this CPU (and build) runs `level` (checked once).
bool word_simd_supported(WordSimd level);
// The best level this CPU runs, or the one DELTASYNC_CODEC_SIMD names ("scalar", "avx2",
// "avx512"; for measurements and tests -- a level the CPU lacks falls back to the best one).
WordSimd word_simd_level();
const char* word_simd_name(WordSimd level);

// A full group, encoded as put_word over its value round then its gap round, lanes descending
// (a gather of the packed symbols, the emitted words compressed into place, the reciprocal
// multiply as two 32x32->64 halves). `level` supported and not kScalar; `x` 64-byte aligned.
void encode_word_group_simd(WordSimd level, uint32_t* x, uint8_t*& ptr, const uint8_t* gap_tokens,
                            const uint8_t* value_tokens, const uint64_t* gap_packed, const uint64_t* value_packed);

inline uint8_t* encode_word_lanes(const uint8_t* gap_tokens, const uint8_t* value_tokens, uint32_t count,
                                  const EncSymbol* gap_enc, const EncSymbol* value_enc, uint8_t* end,
                                  WordSimd simd = word_simd_level()) {
  alignas(64) std::array<uint32_t, kWordLanes> x;
  x.fill(kWordRansLow);
  uint8_t* ptr = end;
  std::array<uint64_t, 256> gap_packed, value_packed;  // the callers' tables have 256 entries
  if (simd != WordSimd::kScalar) {
    for (uint32_t s = 0; s < 256; ++s) gap_packed[s] = pack_word_symbol(gap_enc[s]);
    for (uint32_t s = 0; s < 256; ++s) value_packed[s] = pack_word_symbol(value_enc[s]);
  }
  for (uint32_t g = (count + kWordLanes - 1) / kWordLanes; g-- > 0;) {
    const uint32_t first = g * kWordLanes;
    const uint32_t n = std::min(kWordLanes, count - first);
    if (simd != WordSimd::kScalar && n == kWordLanes && g != 0) {
      encode_word_group_simd(simd, x.data(), ptr, gap_tokens + first, value_tokens + first, gap_packed.data(),
                             value_packed.data());
      continue;
    }
    for (uint32_t l = n; l-- > 0;) put_word(x[l], ptr, value_enc[value_tokens[first + l]]);
    const uint32_t lowest = g == 0 ? 1 : 0;  // change 0 has no gap
    for (uint32_t l = n; l-- > lowest;) put_word(x[l], ptr, gap_enc[gap_tokens[first + l]]);
  }
  for (uint32_t l = kWordLanes; l-- > 0;) {
    ptr -= 4;
    ::deltasync::detail::store_le<uint32_t>(ptr, x[l]);
  }
  return ptr;
}

// ---- decoder ----------------------------------------------------------------------------

// One decode round of lanes [lo, hi): lane l decodes tokens[l] and reads a word if its state
// fell below kWordRansLow. The words are read in lane order from the shared stream.
inline void word_round(uint32_t* x, const WordSlotTable& table, const uint8_t*& stream, uint8_t* tokens, uint32_t lo,
                       uint32_t hi) {
  const uint8_t* ptr = stream;  // a local: the token stores (uint8_t) could alias the caller's pointer
  for (uint32_t l = lo; l < hi; ++l) {
    const uint32_t e = table.entry[x[l] & (kScale - 1)];
    tokens[l] = static_cast<uint8_t>(word_slot_symbol(e));
    const uint32_t y = word_rans_advance(x[l], e);
    const uint32_t k = static_cast<uint32_t>(y < kWordRansLow);
    const uint32_t word = ::deltasync::detail::load_le<uint16_t>(ptr);
    x[l] = k ? (y << 16 | word) : y;
    ptr += 2 * k;
  }
  stream = ptr;
}

// A full group (not the block's first): the gap round then the value round, both as
// word_round over all lanes (a gather of the slot entries, the refilling lanes' words expanded
// into place). `level` supported and not kScalar; `x` 64-byte aligned.
void word_group_simd(WordSimd level, uint32_t* x, const WordSlotTable& gap_table, const WordSlotTable& value_table,
                     const uint8_t*& ptr, uint8_t* gap_tokens, uint8_t* value_tokens);

}  // namespace deltasync::compact::detail
