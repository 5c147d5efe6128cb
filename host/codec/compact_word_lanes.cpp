// The AVX-512 decode of a compact_version 2 group (compact_word_lanes.hpp): the same arithmetic
// as word_round, 16 lanes per instruction. Compiled for AVX-512 in this file only and chosen at
// run time, so the library still runs on CPUs without it (word_round is the reference).
#include "codec/compact_word_lanes.hpp"


#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define DELTASYNC_WORD_SIMD 1
// GCC 12 warns inside its own AVX-512 headers (their _mm512_undefined_* placeholders) when the
// intrinsics are used under a target attribute rather than -mavx512f.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace deltasync::compact::detail {

#if DELTASYNC_WORD_SIMD

namespace {

// 16 lanes of one round: decode, then the lanes whose state fell below kWordRansLow take the
// next words of the stream in lane order (an expand of consecutive words into those lanes).
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m512i word_round16(
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

}  // namespace

__attribute__((target("avx512f,avx512bw,avx512vl"))) void word_group_simd(
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

namespace {

// 16 lanes of one encode round (put_word on each): the emitted words land below `ptr` in
// ascending lane order, which is where the scalar loop, running the lanes downwards, puts them.
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m512i put_words16(
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

}  // namespace

__attribute__((target("avx512f,avx512bw,avx512vl"))) void encode_word_group_simd(
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

bool word_simd_available() {
  static const bool available = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl");
  return available;
}

#else

void word_group_simd(uint32_t* x, const WordSlotTable& gap_table, const WordSlotTable& value_table,
                     const uint8_t*& ptr, uint8_t* gap_tokens, uint8_t* value_tokens) {
  word_round(x, gap_table, ptr, gap_tokens, 0, kWordLanes);
  word_round(x, value_table, ptr, value_tokens, 0, kWordLanes);
}

void encode_word_group_simd(uint32_t*, uint8_t*&, const uint8_t*, const uint8_t*, const uint64_t*, const uint64_t*) {
  __builtin_trap();  // never called: word_simd_available() is false here
}

bool word_simd_available() { return false; }

#endif

}  // namespace deltasync::compact::detail
