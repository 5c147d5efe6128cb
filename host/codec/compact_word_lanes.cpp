// The SIMD group coders of compact_version 2 (compact_word_lanes.hpp): the same arithmetic as
// word_round and put_word, 16 lanes per instruction with AVX-512, 8 with AVX2. Compiled for
// those instruction sets in this file only (target attributes) and chosen at run time, so the
// library still runs on CPUs without them (the scalar loops are the reference).
#include "codec/compact_word_lanes.hpp"

#include <array>
#include <cstdlib>
#include <cstring>
#include <string_view>


#include "codec/simd_x86.hpp"

namespace deltasync::compact::detail {

#if DELTASYNC_X86_SIMD

namespace {

// 16 lanes of one round: decode, then the lanes whose state fell below kWordRansLow take the
// next words of the stream in lane order (an expand of consecutive words into those lanes).
__attribute__((target("avx512f,avx512bw,avx512vl,popcnt"), always_inline)) inline __m512i word_round16(
    __m512i x, const WordSlotTable& table, const uint8_t*& ptr, uint8_t* tokens) {
  const __m512i slot_mask = _mm512_set1_epi32(kScale - 1);
  const __m512i entry = _mm512_i32gather_epi32(_mm512_and_si512(x, slot_mask), table.entry.data(), 4);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(tokens), _mm512_cvtepi32_epi8(_mm512_srli_epi32(entry, 24)));
  const __m512i freq = _mm512_add_epi32(_mm512_and_si512(entry, slot_mask), _mm512_set1_epi32(1));
  const __m512i offset = _mm512_and_si512(_mm512_srli_epi32(entry, kScaleBits), slot_mask);
  const __m512i y = _mm512_add_epi32(_mm512_mullo_epi32(freq, _mm512_srli_epi32(x, kScaleBits)), offset);
  const __mmask16 refill = _mm512_cmplt_epu32_mask(y, _mm512_set1_epi32(kWordRansLow));
  const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ptr)));
  const __m512i placed = _mm512_maskz_expand_epi32(refill, words);
  ptr += 2 * static_cast<uint32_t>(__builtin_popcount(refill));
  return _mm512_mask_or_epi32(y, refill, _mm512_slli_epi32(y, 16), placed);
}

__attribute__((target("avx512f,avx512bw,avx512vl,popcnt"))) void word_group_avx512(
    uint32_t* x, const WordSlotTable& gap_table, const WordSlotTable& value_table, const uint8_t*& stream,
    uint8_t* gap_tokens, uint8_t* value_tokens) {
  const uint8_t* ptr = stream;  // a local: the token stores could alias the caller's pointer
  __m512i low = _mm512_load_si512(x);
  __m512i high = _mm512_load_si512(x + 16);
  low = word_round16(low, gap_table, ptr, gap_tokens);
  high = word_round16(high, gap_table, ptr, gap_tokens + 16);
  low = word_round16(low, value_table, ptr, value_tokens);
  high = word_round16(high, value_table, ptr, value_tokens + 16);
  _mm512_store_si512(x, low);
  _mm512_store_si512(x + 16, high);
  stream = ptr;
}

// 16 lanes of one encode round (put_word on each): the emitted words land below `ptr` in
// ascending lane order, which is where the scalar loop, running the lanes downwards, puts them.
__attribute__((target("avx512f,avx512bw,avx512vl,popcnt"), always_inline)) inline __m512i put_words16(
    __m512i x, const uint8_t* tokens, const uint64_t* packed, uint8_t*& ptr) {
  const __m512i token = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tokens)));
  const __m512i first = _mm512_i32gather_epi64(_mm512_castsi512_si256(token), packed, 8);
  const __m512i second = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(token, 1), packed, 8);
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i rcp = _mm512_permutex2var_epi32(first, evens, second);
  const __m512i fields = _mm512_permutex2var_epi32(first, _mm512_add_epi32(evens, _mm512_set1_epi32(1)), second);
  const __m512i mask13 = _mm512_set1_epi32(0x1FFF);
  const __m512i freq = _mm512_and_si512(fields, mask13);
  const __m512i bias = _mm512_and_si512(_mm512_srli_epi32(fields, 13), mask13);
  const __m512i shift = _mm512_add_epi32(_mm512_srli_epi32(fields, 26), _mm512_set1_epi32(32));
  const __m512i cmpl = _mm512_sub_epi32(_mm512_set1_epi32(kScale), freq);
  const __mmask16 emit = _mm512_cmpge_epu32_mask(x, _mm512_slli_epi32(freq, 19));  // x_max = freq << 19
  const uint32_t emitted = static_cast<uint32_t>(__builtin_popcount(emit));
  ptr -= 2 * emitted;
  const __m256i words = _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(emit, x));
  _mm256_mask_storeu_epi16(ptr, static_cast<__mmask16>((1u << emitted) - 1), words);
  x = _mm512_mask_srli_epi32(x, emit, x, 16);
  // q = (x * rcp) >> shift in 64 bits: even lanes, then odd lanes, each as 8 64-bit products.
  const __m512i low32 = _mm512_set1_epi64(0xFFFFFFFF);
  const __m512i even = _mm512_srlv_epi64(_mm512_mul_epu32(x, rcp), _mm512_and_si512(shift, low32));
  const __m512i odd = _mm512_srlv_epi64(_mm512_mul_epu32(_mm512_srli_epi64(x, 32), _mm512_srli_epi64(rcp, 32)),
                                        _mm512_srli_epi64(shift, 32));
  const __m512i q = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  return _mm512_add_epi32(_mm512_add_epi32(x, bias), _mm512_mullo_epi32(q, cmpl));
}

__attribute__((target("avx512f,avx512bw,avx512vl,popcnt"))) void encode_word_group_avx512(
    uint32_t* x, uint8_t*& stream, const uint8_t* gap_tokens, const uint8_t* value_tokens, const uint64_t* gap_packed,
    const uint64_t* value_packed) {
  uint8_t* ptr = stream;  // a local: the word stores could alias the caller's pointer
  __m512i low = _mm512_load_si512(x);
  __m512i high = _mm512_load_si512(x + 16);
  high = put_words16(high, value_tokens + 16, value_packed, ptr);
  low = put_words16(low, value_tokens, value_packed, ptr);
  high = put_words16(high, gap_tokens + 16, gap_packed, ptr);
  low = put_words16(low, gap_tokens, gap_packed, ptr);
  _mm512_store_si512(x, low);
  _mm512_store_si512(x + 16, high);
  stream = ptr;
}

// ---- AVX2: 8 lanes per instruction ------------------------------------------------------------
//
// AVX2 has no expand or compress: the refilling (emitting) lanes' words are moved into place by a
// permutation looked up by the lanes' mask.

// For each 8-bit mask: byte l = the number of mask bits below l (where lane l's word is, among the
// words the round reads).
constexpr std::array<uint64_t, 256> make_expand() {
  std::array<uint64_t, 256> table{};
  for (uint32_t mask = 0; mask < 256; ++mask) {
    uint32_t rank = 0;
    for (uint32_t l = 0; l < 8; ++l)
      if (mask >> l & 1) table[mask] |= uint64_t{rank++} << (8 * l);
  }
  return table;
}
constexpr std::array<uint64_t, 256> kExpand = make_expand();

// For each 8-bit mask with e bits set: the byte shuffle that puts the mask's lanes' 16-bit words,
// ascending, into the top e word slots of 16 bytes (what is below is overwritten later).
struct CompressTop {
  std::array<std::array<uint8_t, 16>, 256> shuffle{};
};
constexpr CompressTop make_compress_top() {
  CompressTop table;
  for (uint32_t mask = 0; mask < 256; ++mask) {
    uint32_t lanes[8], e = 0;
    for (uint32_t l = 0; l < 8; ++l)
      if (mask >> l & 1) lanes[e++] = l;
    for (uint32_t slot = 0; slot < 8; ++slot) {
      const uint32_t lane = slot >= 8 - e ? lanes[slot - (8 - e)] : 0;
      table.shuffle[mask][2 * slot] = static_cast<uint8_t>(2 * lane);
      table.shuffle[mask][2 * slot + 1] = static_cast<uint8_t>(2 * lane + 1);
    }
  }
  return table;
}
constexpr CompressTop kCompressTop = make_compress_top();

// 8 lanes of one decode round (word_round on each).
__attribute__((target("avx2,popcnt"), always_inline)) inline __m256i word_round8(__m256i x, const WordSlotTable& table,
                                                                                  const uint8_t*& ptr, uint8_t* tokens) {
  const __m256i slot_mask = _mm256_set1_epi32(kScale - 1);
  const __m256i entry =
      _mm256_i32gather_epi32(reinterpret_cast<const int*>(table.entry.data()), _mm256_and_si256(x, slot_mask), 4);
  // The symbols (each entry's top byte) as 8 bytes.
  const __m256i top = _mm256_shuffle_epi8(entry, _mm256_setr_epi8(3, 7, 11, 15, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                  3, 7, 11, 15, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
  const auto low = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(top)));
  const auto high = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_extracti128_si256(top, 1)));
  std::memcpy(tokens, &low, 4);
  std::memcpy(tokens + 4, &high, 4);
  const __m256i freq = _mm256_add_epi32(_mm256_and_si256(entry, slot_mask), _mm256_set1_epi32(1));
  const __m256i offset = _mm256_and_si256(_mm256_srli_epi32(entry, kScaleBits), slot_mask);
  const __m256i y = _mm256_add_epi32(_mm256_mullo_epi32(freq, _mm256_srli_epi32(x, kScaleBits)), offset);
  // y < 2^31 (x < 2^31, freq <= 2^12), so the signed comparison is the unsigned one.
  const __m256i refill = _mm256_cmpgt_epi32(_mm256_set1_epi32(kWordRansLow), y);
  const auto mask = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(refill)));
  const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ptr)));
  const __m256i where = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(kExpand[mask])));
  const __m256i placed = _mm256_permutevar8x32_epi32(words, where);
  ptr += 2 * static_cast<uint32_t>(__builtin_popcount(mask));
  return _mm256_blendv_epi8(y, _mm256_or_si256(_mm256_slli_epi32(y, 16), placed), refill);
}

__attribute__((target("avx2,popcnt"))) void word_group_avx2(uint32_t* x, const WordSlotTable& gap_table,
                                                           const WordSlotTable& value_table, const uint8_t*& stream,
                                                           uint8_t* gap_tokens, uint8_t* value_tokens) {
  const uint8_t* ptr = stream;  // a local: the token stores could alias the caller's pointer
  __m256i lanes[4];
  for (int q = 0; q < 4; ++q) lanes[q] = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + 8 * q));
  for (int q = 0; q < 4; ++q) lanes[q] = word_round8(lanes[q], gap_table, ptr, gap_tokens + 8 * q);
  for (int q = 0; q < 4; ++q) lanes[q] = word_round8(lanes[q], value_table, ptr, value_tokens + 8 * q);
  for (int q = 0; q < 4; ++q) _mm256_store_si256(reinterpret_cast<__m256i*>(x + 8 * q), lanes[q]);
  stream = ptr;
}

// 8 lanes of one encode round (put_word on each, lanes descending): the emitted words land below
// `ptr` in ascending lane order; a 16-byte store ending at `ptr` puts them there (its lower bytes
// fall below the new pointer, where later words or the states overwrite them).
__attribute__((target("avx2,popcnt"), always_inline)) inline __m256i put_words8(__m256i x, const uint8_t* tokens,
                                                                                 const uint64_t* packed, uint8_t*& ptr) {
  uint64_t token_bytes;
  std::memcpy(&token_bytes, tokens, 8);
  const __m256i token = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(token_bytes)));
  const auto* table = reinterpret_cast<const long long*>(packed);
  const __m256i first = _mm256_i32gather_epi64(table, _mm256_castsi256_si128(token), 8);
  const __m256i second = _mm256_i32gather_epi64(table, _mm256_extracti128_si256(token, 1), 8);
  // Lanes 0-3 then 4-7: the low halves (reciprocals), then the high halves (the fields).
  const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i a = _mm256_permutevar8x32_epi32(first, split), b = _mm256_permutevar8x32_epi32(second, split);
  const __m256i rcp = _mm256_permute2x128_si256(a, b, 0x20), fields = _mm256_permute2x128_si256(a, b, 0x31);
  const __m256i mask13 = _mm256_set1_epi32(0x1FFF);
  const __m256i freq = _mm256_and_si256(fields, mask13);
  const __m256i bias = _mm256_and_si256(_mm256_srli_epi32(fields, 13), mask13);
  const __m256i shift = _mm256_add_epi32(_mm256_srli_epi32(fields, 26), _mm256_set1_epi32(32));
  const __m256i cmpl = _mm256_sub_epi32(_mm256_set1_epi32(kScale), freq);
  // x >= freq << 19 (x_max; 2^31 for freq 4096, which x never reaches): x > (freq << 19) - 1 as
  // signed 32-bit numbers, both below 2^31.
  const __m256i emit = _mm256_cmpgt_epi32(x, _mm256_sub_epi32(_mm256_slli_epi32(freq, 19), _mm256_set1_epi32(1)));
  const auto mask = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(emit)));
  // The lanes' low 16 bits as 8 words in lane order, the emitted ones moved to the top.
  const __m256i halves = _mm256_shuffle_epi8(x, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                  0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1));
  const __m128i words = _mm256_castsi256_si128(_mm256_permute4x64_epi64(halves, 0x08));
  const __m128i top = _mm_shuffle_epi8(words, _mm_loadu_si128(reinterpret_cast<const __m128i*>(kCompressTop.shuffle[mask].data())));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(ptr - 16), top);
  ptr -= 2 * static_cast<uint32_t>(__builtin_popcount(mask));
  x = _mm256_blendv_epi8(x, _mm256_srli_epi32(x, 16), emit);
  // q = (x * rcp) >> shift in 64 bits: even lanes, then odd lanes, each as 4 64-bit products.
  const __m256i low32 = _mm256_set1_epi64x(0xFFFFFFFF);
  const __m256i even = _mm256_srlv_epi64(_mm256_mul_epu32(x, rcp), _mm256_and_si256(shift, low32));
  const __m256i odd = _mm256_srlv_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x, 32), _mm256_srli_epi64(rcp, 32)),
                                        _mm256_srli_epi64(shift, 32));
  const __m256i q = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  return _mm256_add_epi32(_mm256_add_epi32(x, bias), _mm256_mullo_epi32(q, cmpl));
}

__attribute__((target("avx2,popcnt"))) void encode_word_group_avx2(uint32_t* x, uint8_t*& stream, const uint8_t* gap_tokens,
                                                                  const uint8_t* value_tokens, const uint64_t* gap_packed,
                                                                  const uint64_t* value_packed) {
  uint8_t* ptr = stream;  // a local: the word stores could alias the caller's pointer
  __m256i lanes[4];
  for (int q = 0; q < 4; ++q) lanes[q] = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + 8 * q));
  for (int q = 4; q-- > 0;) lanes[q] = put_words8(lanes[q], value_tokens + 8 * q, value_packed, ptr);
  for (int q = 4; q-- > 0;) lanes[q] = put_words8(lanes[q], gap_tokens + 8 * q, gap_packed, ptr);
  for (int q = 0; q < 4; ++q) _mm256_store_si256(reinterpret_cast<__m256i*>(x + 8 * q), lanes[q]);
  stream = ptr;
}

bool cpu_has(WordSimd level) {
  switch (level) {
    case WordSimd::kScalar: return true;
    case WordSimd::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
    case WordSimd::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("popcnt");
  }
  return false;
}

}  // namespace

bool word_simd_supported(WordSimd level) {
  static const std::array<bool, 3> supported{true, cpu_has(WordSimd::kAvx2), cpu_has(WordSimd::kAvx512)};
  return supported[static_cast<size_t>(level)];
}

void word_group_simd(WordSimd level, uint32_t* x, const WordSlotTable& gap_table, const WordSlotTable& value_table,
                     const uint8_t*& ptr, uint8_t* gap_tokens, uint8_t* value_tokens) {
  if (level == WordSimd::kAvx512)
    word_group_avx512(x, gap_table, value_table, ptr, gap_tokens, value_tokens);
  else
    word_group_avx2(x, gap_table, value_table, ptr, gap_tokens, value_tokens);
}

void encode_word_group_simd(WordSimd level, uint32_t* x, uint8_t*& ptr, const uint8_t* gap_tokens,
                            const uint8_t* value_tokens, const uint64_t* gap_packed, const uint64_t* value_packed) {
  if (level == WordSimd::kAvx512)
    encode_word_group_avx512(x, ptr, gap_tokens, value_tokens, gap_packed, value_packed);
  else
    encode_word_group_avx2(x, ptr, gap_tokens, value_tokens, gap_packed, value_packed);
}

#else

bool word_simd_supported(WordSimd level) { return level == WordSimd::kScalar; }

void word_group_simd(WordSimd, uint32_t*, const WordSlotTable&, const WordSlotTable&, const uint8_t*&, uint8_t*, uint8_t*) {
  __builtin_trap();  // never called: no level but kScalar is supported here
}

void encode_word_group_simd(WordSimd, uint32_t*, uint8_t*&, const uint8_t*, const uint8_t*, const uint64_t*, const uint64_t*) {
  __builtin_trap();  // never called: no level but kScalar is supported here
}

#endif

const char* word_simd_name(WordSimd level) {
  switch (level) {
    case WordSimd::kAvx2: return "avx2";
    case WordSimd::kAvx512: return "avx512";
    default: return "scalar";
  }
}

WordSimd word_simd_level() {
  static const WordSimd level = [] {
    WordSimd best = WordSimd::kScalar;
    for (WordSimd l : {WordSimd::kAvx2, WordSimd::kAvx512})
      if (word_simd_supported(l)) best = l;
    const char* asked = std::getenv("DELTASYNC_CODEC_SIMD");
    for (WordSimd l : {WordSimd::kScalar, WordSimd::kAvx2, WordSimd::kAvx512})
      if (asked != nullptr && std::string_view(asked) == word_simd_name(l) && word_simd_supported(l)) best = l;
    return best;
  }();
  return level;
}

}  // namespace deltasync::compact::detail
