// The AVX-512 first pass of the block encoder (codec/compact_block_simd.hpp) against the
// hybrid-integer split of docs/compact-format.md (compact_test_support.hpp), change by change:
// every token, and every quad's raw bits as the concatenation of its changes' gap and value raw
// bits, or the refusal of a quad that needs more than 56 bits or of a group with a gap of 2^32 or
// more. The encoder's bytes with and without this pass are compared by the compact tests, which
// ctest runs twice (scalar_paths.*).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "codec/compact_block_simd.hpp"
#include "codec/compact_symbols.hpp"
#include "compact_test_support.hpp"

namespace compact = deltasync::compact;
namespace detail = deltasync::compact::detail;

namespace {

using Split = compact_test::HybridInteger;
using compact_test::hybrid_integer;

uint32_t load(const std::vector<uint8_t>& bytes, size_t i, uint32_t width) {
  uint32_t v = 0;
  std::memcpy(&v, bytes.data() + i * width, width);
  return v;
}

// Gap kinds: 0 adjacent, 1 small, 2 ~2^20 (a quad of four exceeds 56 bits with value bits),
// 3 2^32 and more (the group falls back).
void check(uint32_t width, const std::vector<int>& gap_kinds, bool random_values, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const uint32_t groups = 5, first = 1, count = first + groups * detail::kSimdGroup;
  std::vector<int64_t> positions;
  int64_t p = static_cast<int64_t>(rng() % 100);
  std::vector<uint8_t> new_bits, base_bits;
  for (uint32_t i = 0; i < count; ++i) {
    positions.push_back(p);
    const int kind = gap_kinds[rng() % gap_kinds.size()];
    p += 1 + static_cast<int64_t>(kind == 0 ? 0
                                  : kind == 1 ? rng() % 300
                                  : kind == 2 ? (uint64_t{1} << 20) + rng() % (uint64_t{1} << 20)
                                              : (uint64_t{1} << 32) + rng() % (uint64_t{1} << 33));
    const uint32_t mask = compact::width_mask(width);
    const uint32_t base = static_cast<uint32_t>(rng()) & mask;
    uint32_t v = random_values ? static_cast<uint32_t>(rng()) & mask
                               : compact::from_ordered((compact::to_ordered(base, width) + (rng() & 1 ? 1u : 0u - 2u)) & mask, width);
    if (v == base) v ^= 1;
    new_bits.insert(new_bits.end(), reinterpret_cast<uint8_t*>(&v), reinterpret_cast<uint8_t*>(&v) + width);
    base_bits.insert(base_bits.end(), reinterpret_cast<const uint8_t*>(&base), reinterpret_cast<const uint8_t*>(&base) + width);
  }
  const uint32_t quads = groups * detail::kSimdGroup / detail::kQuadChanges;
  std::vector<uint8_t> gap_tokens(count, 0xEE), value_tokens(count, 0xEE);
  std::vector<uint64_t> quad_raw(quads);
  std::vector<uint8_t> quad_bits(quads + 4);
  detail::tokenize_groups(positions.data(), new_bits.data(), base_bits.data(), width, first, groups, gap_tokens.data(),
                          value_tokens.data(), quad_raw.data(), quad_bits.data());

  uint32_t refused = 0;
  for (uint32_t q = 0; q < quads; ++q) {
    const uint32_t group_first = first + (q / 4) * detail::kSimdGroup;
    bool wide_gap = false;
    for (uint32_t i = group_first; i < group_first + detail::kSimdGroup; ++i)
      wide_gap |= positions[i] - positions[i - 1] - 1 >= (int64_t{1} << 32);
    uint64_t raw = 0;
    uint32_t bits = 0;
    for (uint32_t i = first + q * 4; i < first + q * 4 + 4; ++i) {
      SCOPED_TRACE("change " + std::to_string(i));
      const Split gap = hybrid_integer(static_cast<uint64_t>(positions[i] - positions[i - 1] - 1));
      const Split value = hybrid_integer(compact::value_symbol(load(new_bits, i, width), load(base_bits, i, width), width));
      if (!wide_gap) EXPECT_EQ(gap_tokens[i], gap.token);  // else the caller recodes the change
      EXPECT_EQ(value_tokens[i], value.token);
      for (const Split& s : {gap, value}) {
        if (bits < 64 && bits + s.raw_bits <= 64) raw |= s.raw << bits;  // beyond: refused anyway
        bits += s.raw_bits;
      }
    }
    SCOPED_TRACE("quad " + std::to_string(q));
    if (wide_gap || bits > 56) {
      EXPECT_EQ(quad_bits[q], detail::kQuadTooWide);
      ++refused;
    } else {
      EXPECT_EQ(quad_bits[q], bits);
      EXPECT_EQ(quad_raw[q], raw);
    }
  }
  // Each kind of input reaches the path it is meant for.
  const bool only_narrow = gap_kinds == std::vector<int>{0, 1} && !random_values;
  if (only_narrow) EXPECT_EQ(refused, 0u);
  if (gap_kinds == std::vector<int>{3}) EXPECT_EQ(refused, quads);
}

}  // namespace

TEST(CompactBlockTokens, GroupsMatchTheHybridIntegerSplit) {
  if (!detail::simd_blocks_supported()) GTEST_SKIP() << "no AVX-512 (F, BW, VL, CD, DQ) on this CPU, or DELTASYNC_CODEC_SIMD asks for less";
  uint64_t seed = 1;
  for (uint32_t width : {1u, 2u, 4u})
    for (bool random_values : {false, true})
      for (const std::vector<int>& kinds : std::vector<std::vector<int>>{{0, 1}, {1, 2}, {2}, {0, 1, 3}, {3}}) {
        SCOPED_TRACE("width " + std::to_string(width) + (random_values ? " random values" : " ulp steps") + " gap kinds " +
                     std::to_string(kinds.size()) + " first " + std::to_string(kinds[0]));
        check(width, kinds, random_values, seed++);
      }
}

namespace {

// Sixteen changes after `position` written as the spec's raw bit stream (per change the gap's
// raw bits, then the value's, LSB first) behind `lead` bits of padding, with their tokens.
struct RawGroup {
  std::vector<uint8_t> gap_tokens, value_tokens, bits;
  std::vector<uint64_t> positions;
  std::vector<uint32_t> symbols;
  uint64_t bit_count = 0;
};

RawGroup make_raw_group(const std::vector<uint64_t>& gaps, const std::vector<uint32_t>& symbols, uint64_t position, uint32_t lead) {
  RawGroup g;
  g.bits.assign(1024, 0);
  uint64_t at = lead;
  const auto put = [&](uint64_t v, uint32_t n) {
    for (uint32_t b = 0; b < n; ++b, ++at)
      if (v >> b & 1) g.bits[at >> 3] |= static_cast<uint8_t>(1u << (at & 7));
  };
  for (size_t k = 0; k < gaps.size(); ++k) {
    const Split gap = hybrid_integer(gaps[k]), value = hybrid_integer(symbols[k]);
    g.gap_tokens.push_back(static_cast<uint8_t>(gap.token));
    g.value_tokens.push_back(static_cast<uint8_t>(value.token));
    put(gap.raw, gap.raw_bits);
    put(value.raw, value.raw_bits);
    position += gaps[k] + 1;
    g.positions.push_back(position);
  }
  g.symbols = symbols;
  g.bit_count = at - lead;
  return g;
}

}  // namespace

TEST(CompactBlockSimd, RawGroupsDecodeToTheSpecsIntegers) {
  if (!detail::simd_blocks_supported()) GTEST_SKIP() << "no AVX-512 (F, BW, VL, CD, DQ) on this CPU, or DELTASYNC_CODEC_SIMD asks for less";
  std::mt19937_64 rng(11);
  for (uint32_t width : {1u, 2u, 4u})
    for (int trial = 0; trial < 200; ++trial) {
      SCOPED_TRACE("width " + std::to_string(width) + " trial " + std::to_string(trial));
      std::vector<uint64_t> gaps;
      std::vector<uint32_t> symbols;
      for (uint32_t k = 0; k < detail::kSimdGroup; ++k) {
        const uint64_t kind = rng() % 4;  // adjacent, small, ~2^20, up to 2^32 - 1
        gaps.push_back(kind == 0 ? 0 : kind == 1 ? rng() % 300 : kind == 2 ? rng() % (uint64_t{1} << 21) : rng() % (uint64_t{1} << 32));
        const uint32_t symbol = static_cast<uint32_t>(rng()) & compact::width_mask(width);
        symbols.push_back(rng() % 3 == 0 ? symbol : symbol % 3);
      }
      const uint64_t start = rng() % 1000;
      const uint32_t lead = static_cast<uint32_t>(rng() % 64);
      const RawGroup g = make_raw_group(gaps, symbols, start, lead);
      bool too_wide = false;
      for (uint32_t k = 0; k < detail::kSimdGroup; ++k)
        too_wide |= hybrid_integer(gaps[k]).raw_bits + hybrid_integer(symbols[k]).raw_bits > detail::kMaxSimdRawBits;
      // numel just above the last position, or at it (the group is then refused).
      const bool at_end = rng() % 4 == 0;
      const uint64_t numel = g.positions.back() + (at_end ? 0 : 1);
      std::vector<int64_t> positions(detail::kSimdGroup, -1);
      std::vector<uint8_t> decoded(detail::kSimdGroup * width, 0xEE);
      uint64_t bit_at = lead, position = start;
      const bool taken = detail::decode_raw_group(g.gap_tokens.data(), g.value_tokens.data(), g.bits.data(), bit_at, position, numel,
                                                  width, positions.data(), decoded.data());
      EXPECT_EQ(taken, !too_wide && !at_end);
      if (!taken) {  // nothing advanced, nothing written
        EXPECT_EQ(bit_at, lead);
        EXPECT_EQ(position, start);
        EXPECT_EQ(positions, std::vector<int64_t>(detail::kSimdGroup, -1));
        continue;
      }
      EXPECT_EQ(bit_at, lead + g.bit_count);
      EXPECT_EQ(position, g.positions.back());
      for (uint32_t k = 0; k < detail::kSimdGroup; ++k) {
        EXPECT_EQ(static_cast<uint64_t>(positions[k]), g.positions[k]) << "change " << k;
        EXPECT_EQ(load(decoded, k, width), symbols[k]) << "change " << k;
      }
    }
}

TEST(CompactBlockSimd, RawGroupsLeaveGapsOf2To32AndMoreToTheScalarLoop) {
  if (!detail::simd_blocks_supported()) GTEST_SKIP() << "no AVX-512 (F, BW, VL, CD, DQ) on this CPU, or DELTASYNC_CODEC_SIMD asks for less";
  std::vector<uint64_t> gaps(detail::kSimdGroup, 5);
  std::vector<uint32_t> symbols(detail::kSimdGroup, 1);
  gaps[9] = uint64_t{1} << 32;  // 30 raw bits: fits 56, but not the 32-bit lanes
  const RawGroup g = make_raw_group(gaps, symbols, 0, 0);
  std::vector<int64_t> positions(detail::kSimdGroup);
  std::vector<uint8_t> decoded(detail::kSimdGroup * 2);
  uint64_t bit_at = 0, position = 0;
  EXPECT_FALSE(detail::decode_raw_group(g.gap_tokens.data(), g.value_tokens.data(), g.bits.data(), bit_at, position,
                                        uint64_t{1} << 40, 2, positions.data(), decoded.data()));
  EXPECT_EQ(bit_at, 0u);
}
