// AVX-512 twins of the block coder's per-change passes (compact_block_simd.hpp). Compiled for
// that instruction set here only (target attributes) and chosen at run time, like the word
// coder's SIMD paths (compact_word_lanes.cpp).
#include "codec/compact_block_simd.hpp"

#include <cstring>

#include "codec/compact_symbols.hpp"
#include "codec/compact_word_lanes.hpp"

#include "codec/simd_x86.hpp"

namespace deltasync::compact::detail {

#if DELTASYNC_X86_SIMD

namespace {

#define DELTASYNC_AVX512_INLINE __attribute__((target("avx512f,avx512bw,avx512vl,avx512cd,avx512dq"), always_inline)) inline

// Tokens of 16 integers v < 2^32 (the hybrid integers of compact_codec_block.cpp): v < 16 is its
// own token; else, with n = floor(log2 v), 16 + 4(n - 4) + the two bits under the leading one
// = 4n + those bits, and n - 2 raw bits.
DELTASYNC_AVX512_INLINE void tokenize16(__m512i v, __m512i& token, __m512i& extra) {
  const __m512i n = _mm512_sub_epi32(_mm512_set1_epi32(31), _mm512_lzcnt_epi32(_mm512_or_si512(v, _mm512_set1_epi32(1))));
  const __mmask16 large = _mm512_cmpge_epu32_mask(v, _mm512_set1_epi32(16));
  const __m512i below = _mm512_sub_epi32(n, _mm512_set1_epi32(2));  // small v: a shift of >= 32 (0), masked out
  const __m512i top = _mm512_and_si512(_mm512_srlv_epi32(v, below), _mm512_set1_epi32(3));
  token = _mm512_mask_blend_epi32(large, v, _mm512_add_epi32(_mm512_slli_epi32(n, 2), top));
  extra = _mm512_maskz_mov_epi32(large, below);
}

// value_symbol (compact_symbols.hpp) on 16 lanes.
template <uint32_t W>
DELTASYNC_AVX512_INLINE __m512i ordered16(__m512i bits) {
  const __m512i mask = _mm512_set1_epi32(static_cast<int>(width_mask(W)));
  const __m512i negative = _mm512_sub_epi32(_mm512_setzero_si512(),
                                            _mm512_and_si512(_mm512_srli_epi32(bits, 8 * W - 1), _mm512_set1_epi32(1)));
  return _mm512_xor_si512(bits, _mm512_or_si512(_mm512_and_si512(negative, mask), _mm512_set1_epi32(static_cast<int>(1u << (8 * W - 1)))));
}
template <uint32_t W>
DELTASYNC_AVX512_INLINE __m512i value_symbol16(__m512i new_bits, __m512i base_bits) {
  const __m512i mask = _mm512_set1_epi32(static_cast<int>(width_mask(W)));
  const __m512i diff = _mm512_and_si512(_mm512_sub_epi32(ordered16<W>(new_bits), ordered16<W>(base_bits)), mask);
  const __m512i negative = _mm512_sub_epi32(_mm512_setzero_si512(),
                                            _mm512_and_si512(_mm512_srli_epi32(diff, 8 * W - 1), _mm512_set1_epi32(1)));
  return _mm512_and_si512(_mm512_xor_si512(_mm512_slli_epi32(diff, 1), negative), mask);
}

template <uint32_t W>
DELTASYNC_AVX512_INLINE __m512i load_values16(const uint8_t* p) {
  if constexpr (W == 1) return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  else if constexpr (W == 2) return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  else return _mm512_loadu_si512(p);
}

// Lanes 0-7 or 8-15 of 32-bit lanes as 64-bit lanes.
DELTASYNC_AVX512_INLINE __m512i widen_low(__m512i v) { return _mm512_cvtepu32_epi64(_mm512_castsi512_si256(v)); }
DELTASYNC_AVX512_INLINE __m512i widen_high(__m512i v) { return _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(v, 1)); }

// The raw bits of eight changes (64-bit lanes: gap raw bits, then value raw bits above them)
// merged into two quads, at lanes 0 and 4, with their bit counts. A shift by 64 or more gives
// 0; such a quad has more than 56 bits and is refused by the caller anyway.
DELTASYNC_AVX512_INLINE void quads8(__m512i raw, __m512i bits, __m512i& quad_raw, __m512i& quad_bits) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i pair_raw = _mm512_or_si512(raw, _mm512_sllv_epi64(_mm512_alignr_epi64(zero, raw, 1), bits));
  const __m512i pair_bits = _mm512_add_epi64(bits, _mm512_alignr_epi64(zero, bits, 1));
  quad_raw = _mm512_or_si512(pair_raw, _mm512_sllv_epi64(_mm512_alignr_epi64(zero, pair_raw, 2), pair_bits));
  quad_bits = _mm512_add_epi64(pair_bits, _mm512_alignr_epi64(zero, pair_bits, 2));
}

template <uint32_t W>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512cd,avx512dq"))) void tokenize_groups_w(
    const int64_t* positions, const uint8_t* new_bits, const uint8_t* base_bits, uint32_t first, uint32_t groups,
    uint8_t* gap_tokens, uint8_t* value_tokens, uint64_t* quad_raw, uint8_t* quad_bits) {
  const __m512i one64 = _mm512_set1_epi64(1);
  const __m512i one32 = _mm512_set1_epi32(1);
  const __m512i quad_lanes = _mm512_setr_epi64(0, 4, 8, 12, 0, 0, 0, 0);  // lanes 0, 4 of two vectors
  for (uint32_t g = 0; g < groups; ++g) {
    const uint32_t i = first + g * kSimdGroup;
    // Gaps (position - previous - 1) as 64-bit lanes, then 32-bit when all are below 2^32.
    const __m512i gap_low = _mm512_sub_epi64(_mm512_sub_epi64(_mm512_loadu_si512(positions + i), _mm512_loadu_si512(positions + i - 1)), one64);
    const __m512i gap_high =
        _mm512_sub_epi64(_mm512_sub_epi64(_mm512_loadu_si512(positions + i + 8), _mm512_loadu_si512(positions + i + 7)), one64);
    const __m512i limit = _mm512_set1_epi64(int64_t{1} << 32);
    const bool wide_gap = (_mm512_cmpge_epu64_mask(gap_low, limit) | _mm512_cmpge_epu64_mask(gap_high, limit)) != 0;
    const __m512i gap = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(gap_low)), _mm512_cvtepi64_epi32(gap_high), 1);
    const __m512i symbol = value_symbol16<W>(load_values16<W>(new_bits + size_t{i} * W), load_values16<W>(base_bits + size_t{i} * W));
    __m512i gap_token, gap_extra, value_token, value_extra;
    tokenize16(gap, gap_token, gap_extra);
    tokenize16(symbol, value_token, value_extra);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(gap_tokens + i), _mm512_cvtepi32_epi8(gap_token));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(value_tokens + i), _mm512_cvtepi32_epi8(value_token));
    // Raw bits (extra <= 29 for integers below 2^32): gap_raw | value_raw << gap_extra per change.
    const __m512i gap_raw = _mm512_and_si512(gap, _mm512_sub_epi32(_mm512_sllv_epi32(one32, gap_extra), one32));
    const __m512i value_raw = _mm512_and_si512(symbol, _mm512_sub_epi32(_mm512_sllv_epi32(one32, value_extra), one32));
    const __m512i bits32 = _mm512_add_epi32(gap_extra, value_extra);
    __m512i quads[2], quad_counts[2];
    quads8(_mm512_or_si512(widen_low(gap_raw), _mm512_sllv_epi64(widen_low(value_raw), widen_low(gap_extra))),
           widen_low(bits32), quads[0], quad_counts[0]);
    quads8(_mm512_or_si512(widen_high(gap_raw), _mm512_sllv_epi64(widen_high(value_raw), widen_high(gap_extra))),
           widen_high(bits32), quads[1], quad_counts[1]);
    const uint32_t q = (i - first) / kQuadChanges;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(quad_raw + q),
                        _mm512_castsi512_si256(_mm512_permutex2var_epi64(quads[0], quad_lanes, quads[1])));
    __m512i counts = _mm512_permutex2var_epi64(quad_counts[0], quad_lanes, quad_counts[1]);
    const __mmask8 too_wide = wide_gap ? __mmask8{0x0F} : _mm512_cmpgt_epu64_mask(counts, _mm512_set1_epi64(kMaxSimdRawBits));
    counts = _mm512_mask_mov_epi64(counts, too_wide, _mm512_set1_epi64(kQuadTooWide));
    const auto packed = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm512_cvtepi64_epi8(counts)));
    std::memcpy(quad_bits + q, &packed, 4);
  }
}

// ---- decoder ----------------------------------------------------------------------------------

// The decoder's view of 16 tokens below 128 (integers below 2^32): each integer's base and its
// number of raw bits, v = base + raw. A token t >= 16 has n = (t - 16) / 4 + 2 raw bits and base
// (4 + t mod 4) << n.
DELTASYNC_AVX512_INLINE void join16(__m512i token, __m512i& base, __m512i& extra) {
  const __mmask16 large = _mm512_cmpge_epu32_mask(token, _mm512_set1_epi32(16));
  const __m512i n = _mm512_add_epi32(_mm512_srli_epi32(_mm512_sub_epi32(token, _mm512_set1_epi32(16)), 2), _mm512_set1_epi32(2));
  extra = _mm512_maskz_mov_epi32(large, n);
  base = _mm512_mask_blend_epi32(
      large, token, _mm512_sllv_epi32(_mm512_add_epi32(_mm512_set1_epi32(4), _mm512_and_si512(token, _mm512_set1_epi32(3))), n));
}

// Inclusive prefix sums over 16 32-bit lanes and over 8 64-bit lanes (lanes shifted up, zeros in).
DELTASYNC_AVX512_INLINE __m512i scan16(__m512i x) {
  const __m512i zero = _mm512_setzero_si512();
  x = _mm512_add_epi32(x, _mm512_alignr_epi32(x, zero, 15));
  x = _mm512_add_epi32(x, _mm512_alignr_epi32(x, zero, 14));
  x = _mm512_add_epi32(x, _mm512_alignr_epi32(x, zero, 12));
  return _mm512_add_epi32(x, _mm512_alignr_epi32(x, zero, 8));
}
DELTASYNC_AVX512_INLINE __m512i scan8(__m512i x) {
  const __m512i zero = _mm512_setzero_si512();
  x = _mm512_add_epi64(x, _mm512_alignr_epi64(x, zero, 7));
  x = _mm512_add_epi64(x, _mm512_alignr_epi64(x, zero, 6));
  return _mm512_add_epi64(x, _mm512_alignr_epi64(x, zero, 4));
}
DELTASYNC_AVX512_INLINE uint64_t last64(__m512i x) { return static_cast<uint64_t>(_mm_extract_epi64(_mm512_extracti64x2_epi64(x, 3), 1)); }
DELTASYNC_AVX512_INLINE __m512i narrow(__m512i low, __m512i high) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(low)), _mm512_cvtepi64_epi32(high), 1);
}

// One half (8 changes) of a group: their raw bit words (each change's bits at its lane's bottom)
// split into the gap's raw bits and the value's above them.
DELTASYNC_AVX512_INLINE void split_raw8(__m512i word, __m512i gap_n, __m512i value_n, __m512i& gap_raw, __m512i& value_raw) {
  const __m512i one = _mm512_set1_epi64(1);
  gap_raw = _mm512_and_si512(word, _mm512_sub_epi64(_mm512_sllv_epi64(one, gap_n), one));
  value_raw = _mm512_and_si512(_mm512_srlv_epi64(word, gap_n), _mm512_sub_epi64(_mm512_sllv_epi64(one, value_n), one));
}

template <uint32_t W>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512cd,avx512dq"))) bool decode_raw_group_w(
    const uint8_t* gap_tokens, const uint8_t* value_tokens, const uint8_t* bits, uint64_t& bit_at, uint64_t& position,
    uint64_t numel, int64_t* positions, uint8_t* symbols) {
  // Positions stay below 2^62 + 16 * 2^32: no sum below can wrap.
  if (numel > (uint64_t{1} << 62)) return false;
  const __m512i gap_token = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gap_tokens)));
  const __m512i value_token = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(value_tokens)));
  if (_mm512_cmpge_epu32_mask(gap_token, _mm512_set1_epi32(128)) != 0) return false;  // a gap of 2^32 or more
  __m512i gap_base, gap_n, value_base, value_n;  // value tokens are below 128 for every width
  join16(gap_token, gap_base, gap_n);
  join16(value_token, value_base, value_n);
  const __m512i n = _mm512_add_epi32(gap_n, value_n);
  if (_mm512_cmpgt_epu32_mask(n, _mm512_set1_epi32(kMaxSimdRawBits)) != 0) return false;
  // Each change's raw bits: 8 bytes from the byte holding its first bit, shifted down.
  const __m512i end = scan16(n);
  const __m512i start = _mm512_add_epi32(_mm512_sub_epi32(end, n), _mm512_set1_epi32(static_cast<int>(bit_at & 7)));
  const uint8_t* const from = bits + (bit_at >> 3);
  const __m512i byte = _mm512_srli_epi32(start, 3);
  const __m512i shift = _mm512_and_si512(start, _mm512_set1_epi32(7));
  __m512i gap_raw[2], value_raw[2];
  const __m512i word_low = _mm512_srlv_epi64(_mm512_i32gather_epi64(_mm512_castsi512_si256(byte), from, 1), widen_low(shift));
  const __m512i word_high = _mm512_srlv_epi64(_mm512_i32gather_epi64(_mm512_extracti64x4_epi64(byte, 1), from, 1), widen_high(shift));
  split_raw8(word_low, widen_low(gap_n), widen_low(value_n), gap_raw[0], value_raw[0]);
  split_raw8(word_high, widen_high(gap_n), widen_high(value_n), gap_raw[1], value_raw[1]);
  // gap + 1 per change (up to 2^32), summed into positions after `position`.
  const __m512i gap = _mm512_add_epi32(gap_base, narrow(gap_raw[0], gap_raw[1]));
  const __m512i one = _mm512_set1_epi64(1);
  const __m512i low = _mm512_add_epi64(scan8(_mm512_add_epi64(widen_low(gap), one)), _mm512_set1_epi64(static_cast<int64_t>(position)));
  const __m512i high = _mm512_add_epi64(scan8(_mm512_add_epi64(widen_high(gap), one)), _mm512_set1_epi64(static_cast<int64_t>(last64(low))));
  const uint64_t last = last64(high);
  if (last >= numel) return false;  // the scalar loop names the change
  _mm512_storeu_si512(positions, low);
  _mm512_storeu_si512(positions + 8, high);
  const __m512i symbol = _mm512_add_epi32(value_base, narrow(value_raw[0], value_raw[1]));
  if constexpr (W == 1) _mm_storeu_si128(reinterpret_cast<__m128i*>(symbols), _mm512_cvtepi32_epi8(symbol));
  else if constexpr (W == 2) _mm256_storeu_si256(reinterpret_cast<__m256i*>(symbols), _mm512_cvtepi32_epi16(symbol));
  else _mm512_storeu_si512(symbols, symbol);
  bit_at += static_cast<uint32_t>(_mm_extract_epi32(_mm512_extracti32x4_epi32(end, 3), 3));
  position = last;
  return true;
}

}  // namespace

bool simd_blocks_supported() {
  static const bool supported = word_simd_level() == WordSimd::kAvx512 && __builtin_cpu_supports("avx512cd") &&
                                __builtin_cpu_supports("avx512dq");
  return supported;
}

void tokenize_groups(const int64_t* positions, const uint8_t* new_bits, const uint8_t* base_bits, uint32_t width,
                     uint32_t first, uint32_t groups, uint8_t* gap_tokens, uint8_t* value_tokens, uint64_t* quad_raw,
                     uint8_t* quad_bits) {
  switch (width) {
    case 1: return tokenize_groups_w<1>(positions, new_bits, base_bits, first, groups, gap_tokens, value_tokens, quad_raw, quad_bits);
    case 2: return tokenize_groups_w<2>(positions, new_bits, base_bits, first, groups, gap_tokens, value_tokens, quad_raw, quad_bits);
    default: return tokenize_groups_w<4>(positions, new_bits, base_bits, first, groups, gap_tokens, value_tokens, quad_raw, quad_bits);
  }
}

bool decode_raw_group(const uint8_t* gap_tokens, const uint8_t* value_tokens, const uint8_t* bits, uint64_t& bit_at,
                      uint64_t& position, uint64_t numel, uint32_t width, int64_t* positions, uint8_t* symbols) {
  switch (width) {
    case 1: return decode_raw_group_w<1>(gap_tokens, value_tokens, bits, bit_at, position, numel, positions, symbols);
    case 2: return decode_raw_group_w<2>(gap_tokens, value_tokens, bits, bit_at, position, numel, positions, symbols);
    default: return decode_raw_group_w<4>(gap_tokens, value_tokens, bits, bit_at, position, numel, positions, symbols);
  }
}

#else

bool simd_blocks_supported() { return false; }

void tokenize_groups(const int64_t*, const uint8_t*, const uint8_t*, uint32_t, uint32_t, uint32_t, uint8_t*, uint8_t*, uint64_t*,
                     uint8_t*) {
  __builtin_trap();  // never called: simd_blocks_supported() is false here
}

bool decode_raw_group(const uint8_t*, const uint8_t*, const uint8_t*, uint64_t&, uint64_t&, uint64_t, uint32_t, int64_t*, uint8_t*) {
  __builtin_trap();  // never called: simd_blocks_supported() is false here
}

#endif

}  // namespace deltasync::compact::detail
