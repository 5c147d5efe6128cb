// AVX-512 twins of the tile reorderings' per-change loops (compact_tile_order_simd.hpp),
// compiled for that instruction set here only (target attributes) and chosen at run time.
#include "codec/compact_tile_order_simd.hpp"

#include "codec/simd_x86.hpp"

namespace deltasync::compact::detail {

#if DELTASYNC_X86_SIMD

namespace {

#define DELTASYNC_AVX512_WALK __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,popcnt"), always_inline)) inline

// Four consecutive `W`-byte values of bands a and b as 8 64-bit lanes (a's in lanes 0-3).
template <uint32_t W>
DELTASYNC_AVX512_WALK __m512i load_bits8(const uint8_t* a, const uint8_t* b) {
  if constexpr (W == 1) {
    uint32_t x, y;
    __builtin_memcpy(&x, a, 4);
    __builtin_memcpy(&y, b, 4);
    return _mm512_cvtepu8_epi64(_mm_cvtsi64_si128(static_cast<long long>(uint64_t{x} | uint64_t{y} << 32)));
  } else if constexpr (W == 2) {
    return _mm512_cvtepu16_epi64(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
  } else {
    return _mm512_cvtepu32_epi64(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1));
  }
}

// The first `count` (<= 8) lanes of v, as `W`-byte values, at out (writes 8 values' bytes).
template <uint32_t W>
DELTASYNC_AVX512_WALK void store_bits8(uint8_t* out, __m512i v) {
  if constexpr (W == 1) _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm512_cvtepi64_epi8(v));
  else if constexpr (W == 2) _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi64_epi16(v));
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi64_epi32(v));
}

// kPacked (no base bits to move, flat positions below 2^(64 - 8W)): each change's new bits ride
// in the top bits of its position's lane, so one compress moves both.
template <uint32_t W, bool kBaseBits, bool kPacked>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,popcnt"))) uint64_t walk_runs8_w(const RunWalk& w, uint64_t row,
                                                                                            uint64_t rows, uint64_t* from_out,
                                                                                            uint64_t& at_out) {
  const int64_t* const coded = w.coded;
  const uint8_t* const new_bits = w.new_bits;
  const uint8_t* const base_bits = w.base_bits;
  int64_t* const out_positions = w.out_positions;
  uint8_t* const out_new = w.out_new_bits;
  uint8_t* const out_base = w.out_base_bits;
  // A row writes at most 8 runs * 4 changes, and its last compressed store 8 changes' room.
  constexpr uint64_t kRowRoom = kSimdRunBands * kSimdRunChanges + 8;
  if (w.out_count < kRowRoom) return row;
  const uint64_t last_at = w.out_count - kRowRoom;
  const __m512i longest = _mm512_set1_epi64(static_cast<int64_t>(kSimdRunChanges));
  const __m512i one = _mm512_set1_epi64(1);
  const __m512i position_mask = _mm512_set1_epi64(static_cast<int64_t>((uint64_t{1} << (64 - 8 * W)) - 1));
  __m512i pair_shift[4];  // per pair of bands (2m, 2m + 1): their lanes' band shifts (band 2m's in lanes 0-3)
  for (int m = 0; m < 4; ++m) {
    const int64_t a = w.band_shift[2 * m], b = w.band_shift[2 * m + 1];
    pair_shift[m] = _mm512_setr_epi64(a, a, a, a, b, b, b, b);
  }
  __m512i from = _mm512_loadu_si512(from_out);
  uint64_t at = at_out;
  alignas(64) uint64_t c[kSimdRunBands];
  for (; row < rows && at <= last_at; ++row) {
    const __m512i end = _mm512_loadu_si512(w.run_end + row * kSimdRunBands);
    const __m512i n = _mm512_sub_epi64(_mm512_max_epu64(end, from), from);
    if (_mm512_cmpgt_epu64_mask(n, longest) != 0) break;
    _mm512_store_si512(c, from);
    // The lanes each pair of bands copies: a run of n changes takes its band's first n lanes,
    // 2^n - 1. The eight bands' masks land one per byte, and folding each odd byte's into the
    // high nibble of the byte below leaves the pairs' masks in bytes 0, 2, 4 and 6 (instead of
    // a lane permute and a compare per pair: the compresses already crowd the shuffle port).
    const auto runs = static_cast<uint64_t>(_mm_cvtsi128_si64(_mm512_cvtepi64_epi8(_mm512_sub_epi64(_mm512_sllv_epi64(one, n), one))));
    const uint64_t pairs = runs | runs >> 4;
    const __m512i row_shift = _mm512_set1_epi64(w.row_shift + static_cast<int64_t>(row) * w.row_step);
    for (int m = 0; m < 4; ++m) {
      const uint64_t a = c[2 * m], b = c[2 * m + 1];
      const auto take = static_cast<__mmask8>(pairs >> (16 * m));
      const __m512i positions = _mm512_add_epi64(
          _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(coded + a))),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(coded + b)), 1),
          _mm512_add_epi64(row_shift, pair_shift[m]));
      if constexpr (kPacked) {
        constexpr int kPositionBits = 64 - 8 * static_cast<int>(W);
        const __m512i both = _mm512_maskz_compress_epi64(
            take, _mm512_or_si512(positions, _mm512_slli_epi64(load_bits8<W>(new_bits + a * W, new_bits + b * W), kPositionBits)));
        _mm512_storeu_si512(out_positions + at, _mm512_and_si512(both, position_mask));
        store_bits8<W>(out_new + at * W, _mm512_srli_epi64(both, kPositionBits));
      } else {
        _mm512_storeu_si512(out_positions + at, _mm512_maskz_compress_epi64(take, positions));
        store_bits8<W>(out_new + at * W, _mm512_maskz_compress_epi64(take, load_bits8<W>(new_bits + a * W, new_bits + b * W)));
      }
      if constexpr (kBaseBits)
        store_bits8<W>(out_base + at * W, _mm512_maskz_compress_epi64(take, load_bits8<W>(base_bits + a * W, base_bits + b * W)));
      at += static_cast<uint64_t>(__builtin_popcount(take));
    }
    from = _mm512_add_epi64(from, n);
  }
  _mm512_storeu_si512(from_out, from);
  at_out = at;
  return row;
}

template <uint32_t W>
uint64_t walk_width(const RunWalk& w, uint64_t row, uint64_t rows, uint64_t* from, uint64_t& at) {
  if (w.base_bits != nullptr) return walk_runs8_w<W, true, false>(w, row, rows, from, at);
  if (w.numel <= uint64_t{1} << (64 - 8 * W)) return walk_runs8_w<W, false, true>(w, row, rows, from, at);
  return walk_runs8_w<W, false, false>(w, row, rows, from, at);
}

}  // namespace

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void band_and_coded8(const int64_t* positions, uint64_t count,
                                                                                   uint32_t bands, uint64_t band_width,
                                                                                   uint64_t band_elements, uint8_t* band,
                                                                                   int64_t* coded) {
  // u = p / band_width from a double multiply: below 2^40 exact, or one too small where p is a
  // multiple of the band width and the product rounded down below the integer (tests have
  // such widths); never too large, since the product's error, below q * 2^-52, is less than the
  // 1 / band_width between a quotient q that is not an integer and the next one. The remainder
  // says which. band = u mod bands, row = u / bands, coded = band * band_elements + row *
  // band_width + remainder.
  const __m512d inverse = _mm512_set1_pd(1.0 / static_cast<double>(band_width));
  const __m512i width = _mm512_set1_epi64(static_cast<int64_t>(band_width));
  const __m512i elements = _mm512_set1_epi64(static_cast<int64_t>(band_elements));
  const __m512i band_mask = _mm512_set1_epi64(bands - 1);
  const __m512i band_bits = _mm512_set1_epi64(__builtin_ctz(bands));
  const __m512i one = _mm512_set1_epi64(1);
  for (uint64_t j = 0; j < count; j += 8) {
    const __m512i p = _mm512_loadu_si512(positions + j);
    __m512i u = _mm512_cvttpd_epu64(_mm512_mul_pd(_mm512_cvtepu64_pd(p), inverse));
    __m512i rest = _mm512_sub_epi64(p, _mm512_mullo_epi64(u, width));
    const __mmask8 low = _mm512_cmpge_epu64_mask(rest, width);
    u = _mm512_mask_add_epi64(u, low, u, one);
    rest = _mm512_mask_sub_epi64(rest, low, rest, width);
    const __m512i k = _mm512_and_si512(u, band_mask);
    const __m512i q = _mm512_add_epi64(_mm512_add_epi64(_mm512_mullo_epi64(k, elements),
                                                        _mm512_mullo_epi64(_mm512_srlv_epi64(u, band_bits), width)),
                                       rest);
    _mm512_storeu_si512(coded + j, q);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(band + j), _mm512_cvtepi64_epi8(k));
  }
}

uint64_t walk_runs8(const RunWalk& walk, uint32_t width, uint64_t row, uint64_t rows, uint64_t* from, uint64_t& at) {
  switch (width) {
    case 1: return walk_width<1>(walk, row, rows, from, at);
    case 2: return walk_width<2>(walk, row, rows, from, at);
    default: return walk_width<4>(walk, row, rows, from, at);
  }
}

#else

uint64_t walk_runs8(const RunWalk&, uint32_t, uint64_t, uint64_t, uint64_t*, uint64_t&) {
  __builtin_trap();  // never called: simd_blocks_supported() is false here
}

void band_and_coded8(const int64_t*, uint64_t, uint32_t, uint64_t, uint64_t, uint8_t*, int64_t*) {
  __builtin_trap();  // never called: simd_blocks_supported() is false here
}

#endif

}  // namespace deltasync::compact::detail
