// The 32-lane word-wise rANS stream of compact_version 2 (codec/compact_word_lanes.hpp): the
// encoder's stream decodes back to its tokens, and every SIMD group encoder and decoder this CPU
// runs (AVX2, AVX-512) agrees with the scalar reference byte for byte and lane for lane (the
// levels the CPU lacks are skipped, and said so).
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <random>
#include <vector>

#include "codec/compact_word_lanes.hpp"

namespace compact = deltasync::compact;
namespace detail = deltasync::compact::detail;

namespace {

// A table over `symbols` tokens with skewed frequencies summing to the scale (every symbol >= 1).
struct Table {
  std::vector<uint32_t> freq, start;
  std::vector<compact::EncSymbol> enc;
  detail::WordSlotTable slots{};
  explicit Table(uint32_t symbols, std::mt19937_64& rng) {
    freq.assign(symbols, 1);
    uint32_t left = compact::kScale - symbols;
    for (uint32_t s = 0; s < symbols && left > 0; ++s) {  // roughly geometric, the rest to symbol 0
      const uint32_t f = std::min<uint32_t>(left, static_cast<uint32_t>(rng() % (left / 2 + 1)));
      freq[s] += f;
      left -= f;
    }
    freq[0] += left;
    uint32_t acc = 0;
    for (uint32_t s = 0; s < symbols; ++s) {
      start.push_back(acc);
      enc.push_back(compact::enc_word_symbol(acc, freq[s]));
      for (uint32_t j = 0; j < freq[s]; ++j) slots.entry[acc + j] = compact::word_slot_entry(freq[s], j, s);
      acc += freq[s];
    }
    enc.resize(256);  // the encoder's tables have an entry for every token
  }
  // A token drawn from the table's own distribution (the compressible case) or uniformly.
  uint8_t draw(std::mt19937_64& rng) const {
    const uint32_t slot = static_cast<uint32_t>(rng() % compact::kScale);
    return static_cast<uint8_t>(compact::word_slot_symbol(slots.entry[slot]));
  }
};

struct Decoded {
  std::vector<uint8_t> gap, value;
  size_t consumed = 0;
  bool final_states_ok = true;
};

// The SIMD levels this CPU runs (besides the scalar reference).
std::vector<detail::WordSimd> simd_levels() {
  std::vector<detail::WordSimd> levels;
  for (detail::WordSimd level : {detail::WordSimd::kAvx2, detail::WordSimd::kAvx512})
    if (detail::word_simd_supported(level)) levels.push_back(level);
  return levels;
}

// Decodes `count` changes group by group, with the SIMD group decoder of `simd` for full groups.
Decoded decode(const std::vector<uint8_t>& stream, uint32_t count, const Table& gap, const Table& value, detail::WordSimd simd) {
  std::vector<uint8_t> padded(stream);
  padded.resize(stream.size() + detail::kWordStreamPad, 0);
  alignas(64) std::array<uint32_t, compact::kWordLanes> x;
  const uint8_t* ptr = padded.data();
  for (uint32_t l = 0; l < compact::kWordLanes; ++l, ptr += 4) x[l] = deltasync::detail::load_le<uint32_t>(ptr);
  Decoded out;
  out.gap.assign(count, 0);
  out.value.assign(count, 0);
  for (uint32_t begin = 0; begin < count; begin += compact::kWordLanes) {
    const uint32_t n = std::min(compact::kWordLanes, count - begin);
    if (simd != detail::WordSimd::kScalar && n == compact::kWordLanes && begin != 0) {
      detail::word_group_simd(simd, x.data(), gap.slots, value.slots, ptr, out.gap.data() + begin, out.value.data() + begin);
    } else {
      detail::word_round(x.data(), gap.slots, ptr, out.gap.data() + begin, begin == 0 ? 1 : 0, n);
      detail::word_round(x.data(), value.slots, ptr, out.value.data() + begin, 0, n);
    }
  }
  out.consumed = static_cast<size_t>(ptr - padded.data());
  for (uint32_t l = 0; l < compact::kWordLanes; ++l) out.final_states_ok &= x[l] == compact::kWordRansLow;
  return out;
}

}  // namespace

TEST(CompactWordLanes, StreamDecodesToItsTokensWithAndWithoutSimd) {
  std::mt19937_64 rng(31);
  for (uint32_t count : {1u, 2u, 31u, 32u, 33u, 64u, 95u, 1000u, 16384u}) {
    for (uint32_t symbols : {1u, 2u, 20u, 256u}) {
      SCOPED_TRACE("count " + std::to_string(count) + ", symbols " + std::to_string(symbols));
      const Table gap(symbols, rng), value(std::min(symbols, 64u), rng);
      std::vector<uint8_t> gap_tokens(count), value_tokens(count);
      const bool uniform = rng() % 2;
      for (uint32_t i = 0; i < count; ++i) {
        gap_tokens[i] = i == 0 ? 0 : (uniform ? static_cast<uint8_t>(rng() % symbols) : gap.draw(rng));
        value_tokens[i] = uniform ? static_cast<uint8_t>(rng() % std::min(symbols, 64u)) : value.draw(rng);
      }
      std::vector<uint8_t> buffer(size_t{count} * 4 + detail::kWordStateBytes + 16);
      uint8_t* const end = buffer.data() + buffer.size();
      const uint8_t* const begin = detail::encode_word_lanes(gap_tokens.data(), value_tokens.data(), count,
                                                              gap.enc.data(), value.enc.data(), end, detail::WordSimd::kScalar);
      const std::vector<uint8_t> stream(begin, static_cast<const uint8_t*>(end));
      for (detail::WordSimd level : simd_levels()) {  // every SIMD encoder writes the same bytes
        SCOPED_TRACE(detail::word_simd_name(level));
        std::vector<uint8_t> simd_buffer(buffer.size());
        uint8_t* const simd_end = simd_buffer.data() + simd_buffer.size();
        const uint8_t* const simd_begin = detail::encode_word_lanes(gap_tokens.data(), value_tokens.data(), count,
                                                                   gap.enc.data(), value.enc.data(), simd_end, level);
        ASSERT_EQ(std::vector<uint8_t>(simd_begin, static_cast<const uint8_t*>(simd_end)), stream);
      }
      ASSERT_EQ((stream.size() - detail::kWordStateBytes) % 2, 0u);
      std::vector<detail::WordSimd> levels = simd_levels();
      levels.insert(levels.begin(), detail::WordSimd::kScalar);
      for (detail::WordSimd level : levels) {
        SCOPED_TRACE(detail::word_simd_name(level));
        const Decoded d = decode(stream, count, gap, value, level);
        EXPECT_EQ(d.consumed, stream.size());
        EXPECT_TRUE(d.final_states_ok);
        for (uint32_t i = 1; i < count; ++i) ASSERT_EQ(d.gap[i], gap_tokens[i]) << "gap token of change " << i;
        for (uint32_t i = 0; i < count; ++i) ASSERT_EQ(d.value[i], value_tokens[i]) << "value token of change " << i;
      }
    }
  }
}

TEST(CompactWordLanes, SimdAgreesWithScalarOnArbitraryStreams) {
  // Corrupt input takes the same path through both: random states and words.
  const std::vector<detail::WordSimd> levels = simd_levels();
  if (levels.empty()) GTEST_SKIP() << "neither AVX2 nor AVX-512 on this CPU";
  if (!detail::word_simd_supported(detail::WordSimd::kAvx512)) std::printf("(no AVX-512 on this CPU: AVX2 only)\n");
  std::mt19937_64 rng(77);
  const Table gap(200, rng), value(40, rng);
  for (detail::WordSimd level : levels) {
    SCOPED_TRACE(detail::word_simd_name(level));
    for (int trial = 0; trial < 2000; ++trial) {
      std::vector<uint8_t> words(detail::kWordStreamPad);
      for (auto& b : words) b = static_cast<uint8_t>(rng());
      alignas(64) std::array<uint32_t, compact::kWordLanes> a, b;
      for (uint32_t l = 0; l < compact::kWordLanes; ++l)
        a[l] = b[l] = compact::kWordRansLow + static_cast<uint32_t>(rng() % ((compact::kWordRansLow << 16) - compact::kWordRansLow));
      std::array<uint8_t, compact::kWordLanes> ga{}, va{}, gb{}, vb{};
      const uint8_t* pa = words.data();
      const uint8_t* pb = words.data();
      detail::word_round(a.data(), gap.slots, pa, ga.data(), 0, compact::kWordLanes);
      detail::word_round(a.data(), value.slots, pa, va.data(), 0, compact::kWordLanes);
      detail::word_group_simd(level, b.data(), gap.slots, value.slots, pb, gb.data(), vb.data());
      ASSERT_EQ(a, b);
      ASSERT_EQ(pa, pb);
      ASSERT_EQ(ga, gb);
      ASSERT_EQ(va, vb);
    }
  }
}

TEST(CompactWordLanes, TheLevelFollowsTheCpuAndTheEnvironment) {
  // The best level the CPU runs, unless DELTASYNC_CODEC_SIMD names another it runs (ctest runs
  // this file once more with "scalar": the codec tests then take the scalar paths).
  const char* asked = std::getenv("DELTASYNC_CODEC_SIMD");
  const detail::WordSimd level = detail::word_simd_level();
  EXPECT_TRUE(detail::word_simd_supported(level));
  if (asked != nullptr && std::string(asked) == "scalar") {
    EXPECT_EQ(level, detail::WordSimd::kScalar);
  } else if (asked == nullptr) {
    const std::vector<detail::WordSimd> levels = simd_levels();
    EXPECT_EQ(level, levels.empty() ? detail::WordSimd::kScalar : levels.back());
  }
}
