// Two-phase compact decoding (compact_two_phase.hpp): decoding against no base and rebasing on
// the base bits gathered afterwards must give exactly what decoding against the base gives, for
// every weight dtype and kind of change (ulps across sign and exponent, random bits, sign flips).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "compact_test_support.hpp"
#include "codec/compact_tiles.hpp"
#include "codec/compact_two_phase.hpp"
#include "engine/cpu_engine.hpp"
#include "core/error.hpp"
#include "format/safetensors.hpp"

namespace ds = deltasync;
namespace compact = deltasync::compact;
using namespace compact_test;

namespace {

// One tensor per weight dtype, and a bf16 matrix the codec cuts into tiles (its blocks decode in
// coded order, merged back into flat order); random base bits, ~5% changed by one of three kinds
// of change.
Model random_model(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Model m;
  const ds::DType dtypes[] = {ds::DType::BF16, ds::DType::F16, ds::DType::F32, ds::DType::F8_E4M3, ds::DType::F8_E5M2, ds::DType::BF16};
  for (size_t d = 0; d < std::size(dtypes); ++d) {
    const ds::DType dtype = dtypes[d];
    if (d + 1 < std::size(dtypes))
      m.add("t." + std::string(ds::dtype_name(dtype)), dtype, 3000 + rng() % 2000);
    else
      m.add_shaped("tiled.w", dtype, {256, 512});
    const uint32_t w = m.meta.back().width();
    const uint64_t numel = m.meta.back().numel();
    std::vector<uint8_t>& base = m.base.back();
    std::vector<uint8_t>& current = m.current.back();
    for (auto& b : base) b = static_cast<uint8_t>(rng());
    current = base;
    for (uint64_t i = 0; i < numel; ++i) {
      if (rng() % 20) continue;
      const uint32_t old = load(base, i, w);
      uint32_t v = old;
      switch (rng() % 3) {
        case 0: v = compact::from_ordered((compact::to_ordered(old, w) + (rng() & 1 ? 1u : ~0u)) & compact::width_mask(w), w); break;
        case 1: v = static_cast<uint32_t>(rng()) & compact::width_mask(w); break;
        default: v = old ^ (1u << (8 * w - 1)); break;
      }
      if (v == old) v ^= 1;
      store(current, i, w, v);
    }
  }
  m.encode();
  return m;
}

ds::st::File compact_file(const Model& m) {
  ds::DeltaInfo info;
  info.model_version = 2;
  info.base_version = 1;
  compact::Options options;
  options.block_elements = 64;  // several blocks per tensor
  return ds::st::File::from_bytes(compact::serialize_compact_delta(m.meta, m.delta.view(), info, options), "d.safetensors");
}

}  // namespace

TEST(CompactTwoPhase, UnbasedDecodeThenRebaseEqualsDirectDecode) {
  for (uint64_t seed : {1u, 2u, 3u}) {
    const Model m = random_model(seed);
    const ds::st::File file = compact_file(m);
    compact::DecodedDelta direct, unbased;
    const auto refs = m.base_refs();
    const size_t last = m.meta.size() - 1;
    ASSERT_GT(compact::choose_tiles(m.meta[last].shape, m.delta.view().count(last), 64, compact::Options{}.max_tiles).bands, 1u);
    compact::decode_compact_delta(file, m.meta, refs, direct);
    compact::decode_compact_delta_unbased(file, m.meta, unbased);
    EXPECT_EQ(unbased.storage.offsets, direct.storage.offsets);
    EXPECT_EQ(unbased.storage.indices, direct.storage.indices);
    EXPECT_EQ(unbased.changed_names, direct.changed_names);
    EXPECT_EQ(unbased.info.model_version, 2u);
    EXPECT_NE(unbased.storage.values, direct.storage.values);  // really relative to a zero base
    EXPECT_TRUE(unbased.storage.base_values.empty());              // no base, no base bits
    // A decoded delta reused from a decode against the base gives the same unbased result.
    compact::decode_compact_delta_unbased(file, m.meta, direct);
    EXPECT_EQ(direct.storage.values, unbased.storage.values);
    EXPECT_TRUE(direct.storage.base_values.empty());
    compact::decode_compact_delta(file, m.meta, refs, direct);

    // Phase 2: gather the base bits at the positions, rebase per tensor.
    std::vector<uint8_t> rebased(unbased.storage.values.size());
    for (size_t t = 0; t < m.meta.size(); ++t) {
      const uint32_t w = m.meta[t].width();
      const uint64_t first = unbased.storage.offsets[t], count = unbased.storage.offsets[t + 1] - first;
      std::vector<uint8_t> gathered(count * w);
      for (uint64_t j = 0; j < count; ++j)
        std::memcpy(gathered.data() + j * w, m.base[t].data() + unbased.storage.indices[first + j] * w, w);
      const uint64_t at = unbased.storage.value_offsets[t];
      compact::rebase_values(std::span(unbased.storage.values).subspan(at, count * w), gathered, w,
                             std::span(rebased).subspan(at, count * w));
    }
    EXPECT_EQ(rebased, direct.storage.values) << "seed " << seed;
    EXPECT_EQ(rebased, m.delta.values) << "seed " << seed;
  }
}

TEST(CompactTwoPhase, RebaseInPlaceAndRefusesMismatchedSizes) {
  // bf16 1.0 (0x3F80) -> next ulp, coded over a zero base, rebased in place.
  const uint32_t w = 2;
  const uint32_t base = 0x3F80, target = 0x3F81;
  const uint32_t symbol = compact::value_symbol(target, base, w);
  const uint32_t unbased = compact::apply_value_symbol(symbol, 0, w);
  std::vector<uint8_t> values(2), base_bits(2);
  std::memcpy(values.data(), &unbased, 2);
  std::memcpy(base_bits.data(), &base, 2);
  compact::rebase_values(values, base_bits, w, values);
  EXPECT_EQ(load(values, 0, w), target);

  std::vector<uint8_t> three(3), out(3);
  EXPECT_THROW(compact::rebase_values(three, base_bits, w, out), ds::Error);
  EXPECT_THROW(compact::rebase_values(three, three, w, out), ds::Error);  // 3 bytes are not whole bf16 elements
  EXPECT_THROW(compact::rebase_values(values, base_bits, 3, values), ds::Error);
}

TEST(CompactTwoPhase, UnbasedDecodeRefusesCorruptPayloadsLikeTheDirectOne) {
  const Model m = random_model(9);
  const ds::st::File good = compact_file(m);
  std::vector<uint8_t> bytes(good.size_bytes());
  {
    // Rebuild the file bytes and truncate the last tensor's payload by flipping its last bytes.
    ds::DeltaInfo info;
    info.model_version = 2;
    info.base_version = 1;
    compact::Options options;
    options.block_elements = 64;
    bytes = compact::serialize_compact_delta(m.meta, m.delta.view(), info, options);
  }
  for (size_t k = 1; k <= 4; ++k) bytes[bytes.size() - k] ^= 0xA5;
  const ds::st::File bad = ds::st::File::from_bytes(std::move(bytes), "bad.safetensors");
  compact::DecodedDelta direct, unbased;
  const auto refs = m.base_refs();
  EXPECT_THROW(compact::decode_compact_delta(bad, m.meta, refs, direct), ds::Error);
  try {
    compact::decode_compact_delta_unbased(bad, m.meta, unbased);
    FAIL() << "corrupt payload decoded";
  } catch (const ds::Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.safetensors"), std::string::npos) << e.what();
  }
}
