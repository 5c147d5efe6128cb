// The compact delta format: bit-exact round trips for every width and weight dtype, block
// boundaries, the container, and clean refusal of every kind of corrupt payload.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "compact_test_support.hpp"
#include "codec/compact_codec.hpp"
#include "engine/cpu_engine.hpp"
#include "core/error.hpp"
#include "format/safetensors.hpp"

namespace ds = deltasync;
namespace compact = deltasync::compact;
using namespace compact_test;

namespace {

// Encodes, decodes against the base, applies, and checks that the result equals `current`.
void expect_round_trip_version(Model& f, uint32_t block_elements, uint32_t version) {
  f.encode();
  compact::Options options;
  options.block_elements = block_elements;
  options.version = version;
  const auto encoded = compact::encode(f.meta, f.delta.view(), options);
  compact::DecodedDelta decoded;
  const auto refs = f.base_refs();
  compact::decode(views_of(encoded), f.meta, refs, "mem", decoded);
  // Same positions, new bits and base bits as the encode produced.
  EXPECT_EQ(decoded.storage.offsets, f.delta.offsets);
  EXPECT_EQ(decoded.storage.indices, f.delta.indices);
  EXPECT_EQ(decoded.storage.values, f.delta.values);
  EXPECT_EQ(decoded.storage.base_values, f.delta.base_values);

  std::vector<std::vector<uint8_t>> target = f.base;
  std::vector<ds::TensorRef> targets;
  for (size_t t = 0; t < f.meta.size(); ++t) targets.push_back({f.meta[t].name, target[t].data(), f.meta[t].numel(), f.meta[t].width()});
  ds::cpu::apply(targets, decoded.patches(f.meta));
  for (size_t t = 0; t < f.meta.size(); ++t) EXPECT_EQ(target[t], f.current[t]) << f.meta[t].name;

  // Serial and parallel encodes produce the same bytes.
  options.parallel = false;
  const auto serial = compact::encode(f.meta, f.delta.view(), options);
  ASSERT_EQ(serial.size(), encoded.size());
  for (size_t i = 0; i < serial.size(); ++i) {
    EXPECT_EQ(serial[i].block_index, encoded[i].block_index);
    EXPECT_EQ(serial[i].payload, encoded[i].payload);
    EXPECT_EQ(serial[i].version, version);
  }
}

// Both compact versions.
void expect_round_trip(Model& f, uint32_t block_elements) {
  for (uint32_t version : {compact::kFormatVersion1, compact::kFormatVersion2}) {
    SCOPED_TRACE("compact_version " + std::to_string(version));
    expect_round_trip_version(f, block_elements, version);
  }
}

const ds::DType kWeightDtypes[] = {ds::DType::BF16, ds::DType::F16, ds::DType::F32, ds::DType::F8_E4M3,
                                   ds::DType::F8_E5M2};

}  // namespace

TEST(CompactValueSymbol, OneUlpIsSmallAcrossSignAndExponent) {
  // bf16: +0 -> -0 is one ordered step, 1.0 (0x3F80) -> largest below 1.0 (0x3F7F) is one step.
  EXPECT_EQ(compact::value_symbol(0x8000, 0x0000, 2), 1u);
  EXPECT_EQ(compact::value_symbol(0x0000, 0x8000, 2), 2u);
  EXPECT_EQ(compact::value_symbol(0x3F7F, 0x3F80, 2), 1u);
  EXPECT_EQ(compact::value_symbol(0x0001, 0x8001, 2), 6u);  // -tiny -> +tiny: three steps (-0, +0 between)
  EXPECT_EQ(compact::value_symbol(0x3F800000u, 0x3F7FFFFFu, 4), 2u);
  EXPECT_EQ(compact::value_symbol(0x81, 0x80, 1), 1u);
}

TEST(CompactValueSymbol, InvertsForEveryPairOfBytesAndRandomWideValues) {
  for (uint32_t a = 0; a < 256; ++a)
    for (uint32_t b = 0; b < 256; ++b) ASSERT_EQ(compact::apply_value_symbol(compact::value_symbol(a, b, 1), b, 1), a);
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t a = static_cast<uint32_t>(rng()), b = static_cast<uint32_t>(rng());
    ASSERT_EQ(compact::apply_value_symbol(compact::value_symbol(a, b, 4), b, 4), a);
    ASSERT_EQ(compact::apply_value_symbol(compact::value_symbol(a & 0xFFFF, b & 0xFFFF, 2), b & 0xFFFF, 2), a & 0xFFFF);
  }
}

TEST(CompactRoundTrip, EveryDtypeDensityAndChangeKind) {
  std::mt19937_64 rng(1234);
  const double densities[] = {0.0, 0.001, 0.003, 0.01, 0.05, 0.5, 1.0};
  for (ds::DType dtype : kWeightDtypes) {
    for (double density : densities) {
      for (Change kind : {Change::Ulp, Change::Random, Change::SignFlip}) {
        Model f = sweep_model(dtype, density, kind, rng);
        SCOPED_TRACE(sweep_case(dtype, density, kind));
        expect_round_trip(f, 1000);
      }
    }
  }
}

TEST(CompactRoundTrip, BlockBoundariesAndLargeGaps) {
  std::mt19937_64 rng(99);
  for (uint32_t block : {1u, 2u, 3u, 7u, 31u, 32u, 33u, 64u, 65u, 16384u}) {
    Model f;
    f.add("a", ds::DType::BF16, 5000);
    f.add("b", ds::DType::F32, 3);
    fill_base(f.base[0], 2, rng, false);
    fill_base(f.base[1], 4, rng, true);
    make_changes(f, 0, 0.2, Change::Ulp, rng);
    f.current[1] = f.base[1];
    store(f.current[1], 2, 4, load(f.base[1], 2, 4) ^ 0x7FC00001u);  // NaN payload differences
    // Last element and first element changed: the extreme gaps.
    store(f.current[0], 0, 2, load(f.base[0], 0, 2) ^ 0x8000);
    store(f.current[0], 4999, 2, load(f.base[0], 4999, 2) ^ 0x0001);
    SCOPED_TRACE("block " + std::to_string(block));
    expect_round_trip(f, block);
  }
  // One change at each end of a big tensor: a gap needing many raw bits.
  Model f;
  f.add("big", ds::DType::F8_E4M3, uint64_t{1} << 22);
  f.current[0] = f.base[0];
  f.current[0][0] = 1;
  f.current[0].back() = 0x80;
  expect_round_trip(f, 16384);
}

TEST(CompactRoundTrip, UlpChangesCompressWellBelowTheInteroperableLayout) {
  std::mt19937_64 rng(5);
  Model f;
  f.add("w", ds::DType::BF16, 1 << 20);
  fill_base(f.base[0], 2, rng, false);
  make_changes(f, 0, 0.01, Change::Ulp, rng);
  f.encode();
  const auto encoded = compact::encode(f.meta, f.delta.view());
  ASSERT_EQ(encoded.size(), 1u);
  const double per_change =
      static_cast<double>(encoded[0].block_index.size() + encoded[0].payload.size()) / f.delta.indices.size();
  // 1% uniform positions carry ~1.0 byte, these value changes ~0.17 byte.
  EXPECT_LT(per_change, 1.35);
  EXPECT_GT(per_change, 0.9);
}

// ---- container ----------------------------------------------------------------------------

namespace {

Model small_model(std::mt19937_64& rng) {
  Model f;
  f.add("model.embed", ds::DType::BF16, 4096);
  f.add("model.norm", ds::DType::BF16, 64);
  f.add("model.fp8", ds::DType::F8_E5M2, 999);
  for (size_t t = 0; t < f.meta.size(); ++t) {
    fill_base(f.base[t], f.meta[t].width(), rng, false);
    make_changes(f, t, t == 1 ? 0.0 : 0.05, Change::Ulp, rng);
  }
  f.encode();
  return f;
}

}  // namespace

// Container layout 1 (a NAME.cindex / NAME.cdata pair per changed tensor, names in the header);
// the indexed layout has its own tests (test_compact_indexed.cpp).
TEST(CompactFile, SerializeReadDecodeApply) {
  std::mt19937_64 rng(11);
  Model f = small_model(rng);
  ds::DeltaInfo info;
  info.model_version = 8;
  info.base_version = 7;
  info.extra["note"] = "hello";
  compact::Options options;
  options.block_elements = 50;
  options.layout = compact::kLayout1;
  auto bytes = compact::serialize_compact_delta(f.meta, f.delta.view(), info, options);
  const ds::st::File file = ds::st::File::from_bytes(std::move(bytes), "d.safetensors");
  EXPECT_TRUE(compact::is_compact_delta(file));
  const auto& md = file.metadata();
  EXPECT_EQ(md.at("sparse"), "True");
  EXPECT_EQ(md.at("format"), "compact");
  EXPECT_EQ(md.at("compact_version"), "1");
  EXPECT_EQ(md.at("compact_block_elements"), "50");
  EXPECT_EQ(md.at("model_version"), "8");
  EXPECT_EQ(md.at("base_version"), "7");
  EXPECT_EQ(md.at("note"), "hello");
  EXPECT_EQ(md.at("changed_params"), "[\"model.embed\",\"model.fp8\"]");
  EXPECT_EQ(md.at("total_changed_elements"), std::to_string(f.delta.indices.size()));
  EXPECT_NE(file.find("model.embed.cindex"), nullptr);
  EXPECT_NE(file.find("model.fp8.cdata"), nullptr);
  EXPECT_EQ(file.find("model.norm.cindex"), nullptr);

  compact::DecodedDelta decoded;
  const auto refs = f.base_refs();
  const auto patches = compact::decode_compact_delta(file, f.meta, refs, decoded);
  EXPECT_EQ(decoded.info.model_version, 8u);
  EXPECT_EQ(decoded.info.base_version, std::optional<uint64_t>(7));
  EXPECT_EQ(decoded.info.extra.at("note"), "hello");
  EXPECT_EQ(decoded.changed_names, (std::vector<std::string>{"model.embed", "model.fp8"}));
  ASSERT_EQ(patches.size(), 3u);
  EXPECT_EQ(patches[1].count, 0u);
  std::vector<std::vector<uint8_t>> target = f.base;
  std::vector<ds::TensorRef> targets;
  for (size_t t = 0; t < f.meta.size(); ++t) targets.push_back({f.meta[t].name, target[t].data(), f.meta[t].numel(), f.meta[t].width()});
  ds::cpu::apply(targets, patches);
  EXPECT_EQ(target, f.current);
}

TEST(CompactFile, WritesPreEncodedTensorsOnlyWhenTheyMatchTheDelta) {
  std::mt19937_64 rng(13);
  Model f = small_model(rng);
  const std::vector<compact::EncodedTensor> encoded = compact::encode(f.meta, f.delta.view());
  ASSERT_EQ(encoded.size(), 2u);
  const std::string path = ::testing::TempDir() + "/pre_encoded.safetensors";
  std::remove(path.c_str());
  compact::write_compact_delta(path, f.meta, f.delta.view(), {}, encoded);
  const ds::st::File file = ds::st::File::open(path);
  compact::DecodedDelta decoded;
  const auto refs = f.base_refs();
  const auto patches = compact::decode_compact_delta(file, f.meta, refs, decoded);
  EXPECT_EQ(decoded.storage.indices, f.delta.indices);

  // Encoded tensors of another change set: refused before anything is written.
  const std::string bad_path = ::testing::TempDir() + "/pre_encoded_bad.safetensors";
  auto refused = [&](std::vector<compact::EncodedTensor> tampered, const char* what) {
    std::remove(bad_path.c_str());
    EXPECT_THROW(compact::write_compact_delta(bad_path, f.meta, f.delta.view(), {}, std::move(tampered)), ds::Error)
        << what;
    EXPECT_FALSE(std::filesystem::exists(bad_path)) << what;
  };
  refused({encoded[0]}, "one tensor missing");
  refused({encoded[0], encoded[1], encoded[1]}, "one tensor too many");
  refused({encoded[1], encoded[0]}, "out of model order");
  std::vector<compact::EncodedTensor> miscounted = encoded;
  miscounted[1].changed += 1;
  refused(miscounted, "change count differs");
}

TEST(CompactFile, RefusesAnotherBaseOrFormat) {
  std::mt19937_64 rng(12);
  Model f = small_model(rng);
  compact::Options layout1;  // names in the header (the indexed layout: test_compact_indexed.cpp)
  layout1.layout = compact::kLayout1;
  const ds::st::File file = ds::st::File::from_bytes(compact::serialize_compact_delta(f.meta, f.delta.view(), {}, layout1), "d");
  const auto refs = f.base_refs();
  compact::DecodedDelta decoded;

  // A base whose tensor has another dtype (same width): the recorded tensor_shapes differ.
  auto other = f.meta;
  other[2].dtype = ds::DType::F8_E4M3;
  EXPECT_THROW(compact::decode_compact_delta(file, other, refs, decoded), ds::Error);
  // A base that lacks a changed tensor.
  std::vector<ds::TensorMeta> fewer(f.meta.begin(), f.meta.begin() + 2);
  std::vector<ds::ConstTensorRef> fewer_refs(refs.begin(), refs.begin() + 2);
  try {
    compact::decode_compact_delta(file, fewer, fewer_refs, decoded);
    FAIL() << "decoded against a base without model.fp8";
  } catch (const ds::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.fp8"), std::string::npos) << e.what();
  }
  // An interoperable-layout file is not a compact delta.
  ds::st::Metadata md{{"format", "trl"}, {"sparse", "True"}};
  const ds::st::File trl = ds::st::File::from_bytes(ds::st::serialize({}, md), "t");
  EXPECT_FALSE(compact::is_compact_delta(trl));
  EXPECT_THROW(compact::decode_compact_delta(trl, f.meta, refs, decoded), ds::Error);
}

// A compact_version 2 file records its version, decodes like version 1, is smaller than the
// interoperable layout by about as much; the reader refuses unknown versions and a writer
// refuses tensors coded in two versions.
TEST(CompactFile, Version2RoundTripsAndVersionsAreChecked) {
  std::mt19937_64 rng(15);
  Model f = small_model(rng);
  compact::Options v2;
  v2.version = compact::kFormatVersion2;
  v2.block_elements = 40;
  const ds::st::File file =
      ds::st::File::from_bytes(compact::serialize_compact_delta(f.meta, f.delta.view(), {}, v2), "d2.safetensors");
  EXPECT_EQ(file.metadata().at("compact_version"), "2");
  compact::DecodedDelta decoded;
  const auto refs = f.base_refs();
  compact::decode_compact_delta(file, f.meta, refs, decoded);
  EXPECT_EQ(decoded.storage.indices, f.delta.indices);
  EXPECT_EQ(decoded.storage.values, f.delta.values);
  EXPECT_EQ(decoded.storage.base_values, f.delta.base_values);

  // The same bytes labelled version 1 (or 3) are refused, not misread.
  const auto relabelled = [&](const std::string& version) {
    std::vector<ds::st::WriteTensor> tensors;
    for (const ds::st::TensorInfo& t : file.tensors()) tensors.push_back({t.name, t.dtype, t.shape, file.bytes(t)});
    ds::st::Metadata md = file.metadata();
    md["compact_version"] = version;
    return ds::st::File::from_bytes(ds::st::serialize(tensors, md), "d2.safetensors");
  };
  EXPECT_THROW(compact::decode_compact_delta(relabelled("1"), f.meta, refs, decoded), ds::Error);
  try {
    compact::decode_compact_delta(relabelled("3"), f.meta, refs, decoded);
    FAIL() << "compact_version 3 accepted";
  } catch (const ds::Error& e) {
    EXPECT_EQ(std::string(e.what()), "d2.safetensors: unsupported compact_version '3' (this build reads 1 and 2)");
  }

  // Tensors coded in two versions cannot share a file; an unknown version cannot be written.
  auto mixed = compact::encode(f.meta, f.delta.view(), v2);
  ASSERT_EQ(mixed.size(), 2u);
  mixed[1] = compact::encode(f.meta, f.delta.view()).at(1);
  EXPECT_THROW(compact::serialize_compact_delta(f.meta, f.delta.view(), {}, mixed), ds::Error);
  compact::Options v3;
  v3.version = 3;
  EXPECT_THROW(compact::encode(f.meta, f.delta.view(), v3), ds::Error);
}

// The compact reader's numbers (its model_version and its total_changed_elements, which once
// allowed any 20 digits through std::stoull) follow the one rule, in one line naming the file.
TEST(CompactFile, RefusesSignedOrSpacedNumbers) {
  std::mt19937_64 rng(14);
  Model f = small_model(rng);
  const ds::st::File good = ds::st::File::from_bytes(compact::serialize_compact_delta(f.meta, f.delta.view(), {}), "d");
  auto decode_error = [&](const std::string& key, const std::string& value) {
    std::vector<ds::st::WriteTensor> tensors;
    for (const ds::st::TensorInfo& t : good.tensors()) tensors.push_back({t.name, t.dtype, t.shape, good.bytes(t)});
    ds::st::Metadata md = good.metadata();
    md[key] = value;
    const ds::st::File file = ds::st::File::from_bytes(ds::st::serialize(tensors, md), "d.safetensors");
    const auto refs = f.base_refs();
    compact::DecodedDelta decoded;
    try {
      compact::decode_compact_delta(file, f.meta, refs, decoded);
    } catch (const ds::BadInputError& e) {
      return std::string(e.what());
    }
    return std::string("decoded");
  };
  const std::string total = good.metadata().at("total_changed_elements");
  EXPECT_EQ(decode_error("total_changed_elements", total), "decoded");
  EXPECT_EQ(decode_error("total_changed_elements", "+" + total),
            "d.safetensors: metadata total_changed_elements '+" + total + "': not a decimal integer");
  EXPECT_EQ(decode_error("total_changed_elements", " " + total),
            "d.safetensors: metadata total_changed_elements ' " + total + "': not a decimal integer");
  EXPECT_EQ(decode_error("total_changed_elements", "99999999999999999999"),
            "d.safetensors: metadata total_changed_elements '99999999999999999999': out of range (max 18446744073709551615)");
  EXPECT_EQ(decode_error("model_version", "+7"), "d.safetensors: metadata model_version '+7': not a decimal integer");
  EXPECT_EQ(decode_error("model_version", " 7"), "d.safetensors: metadata model_version ' 7': not a decimal integer");
}

// ---- corrupt payloads ---------------------------------------------------------------------

namespace {

// One tensor with multi-block changes, large random value changes (so the raw bit stream is
// long) and the decode inputs; corrupt() edits the bytes, decode_error() returns the message.
struct Corruptible : EditableTensor {
  Model f;

  explicit Corruptible(uint32_t version) {
    std::mt19937_64 rng(77);
    f.add("layer.w", ds::DType::BF16, 40000);
    fill_base(f.base[0], 2, rng, true);
    make_changes(f, 0, 0.05, Change::Random, rng);
    f.encode();
    compact::Options options;
    options.block_elements = 500;
    options.version = version;
    e = compact::encode(f.meta, f.delta.view(), options).at(0);
  }

  std::string decode_error() const {
    compact::DecodedDelta decoded;
    const auto refs = f.base_refs();
    try {
      compact::decode(views(), f.meta, refs, "bad.safetensors", decoded);
    } catch (const ds::Error& err) {
      const std::string msg = err.what();
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
      EXPECT_EQ(msg.rfind("bad.safetensors: tensor layer.w", 0), 0u) << msg;
      return msg;
    }
    return "";
  }
};

#define EXPECT_REFUSED(c, fragment)                                                   \
  do {                                                                                \
    const std::string msg = (c).decode_error();                                       \
    EXPECT_NE(msg.find(fragment), std::string::npos) << "message: '" << msg << "'"; \
  } while (0)

// Every corruption test runs on both compact versions.
class CompactCorrupt : public ::testing::TestWithParam<uint32_t> {};

}  // namespace

INSTANTIATE_TEST_SUITE_P(Versions, CompactCorrupt, ::testing::Values(compact::kFormatVersion1, compact::kFormatVersion2),
                         [](const ::testing::TestParamInfo<uint32_t>& info) { return "v" + std::to_string(info.param); });

TEST_P(CompactCorrupt, UntouchedDecodes) {
  Corruptible c(GetParam());
  ASSERT_GT(c.blocks(), 3u);
  EXPECT_EQ(c.decode_error(), "");
}

TEST_P(CompactCorrupt, TruncatedPayload) {
  Corruptible c(GetParam());
  c.e.payload.pop_back();
  EXPECT_REFUSED(c, "payload has");
  // Consistently shortened last block (its raw bits lose a byte): the stream runs dry.
  Corruptible d(GetParam());
  const size_t last = d.record(d.blocks() - 1);
  d.e.payload.pop_back();
  d.set<uint32_t>(last + Corruptible::kBits, d.get<uint32_t>(last + Corruptible::kBits) - 1);
  d.set<uint64_t>(Corruptible::kHeaderPayload, d.e.payload.size());
  EXPECT_REFUSED(d, "block " + std::to_string(d.blocks() - 1) + ": raw bit stream truncated");
  // A block whose rANS stream lost bytes (the raw bits slide into it).
  Corruptible r(GetParam());
  r.set<uint32_t>(r.record(1) + Corruptible::kRans, r.get<uint32_t>(r.record(1) + Corruptible::kRans) - 3);
  r.set<uint32_t>(r.record(1) + Corruptible::kBits, r.get<uint32_t>(r.record(1) + Corruptible::kBits) + 3);
  EXPECT_REFUSED(r, "block 1: ");
  // The block index itself cut short.
  Corruptible i(GetParam());
  i.e.block_index.resize(i.e.block_index.size() - 5);
  EXPECT_REFUSED(i, "block index has");
  i.e.block_index.resize(10);
  EXPECT_REFUSED(i, "block index truncated");
}

TEST_P(CompactCorrupt, BadBlockIndex) {
  for (const BlockIndexDefect& defect : block_index_defects()) {
    SCOPED_TRACE(defect.what);
    Corruptible c(GetParam());
    defect.apply(c);
    EXPECT_REFUSED(c, defect.fragment);
  }
}

TEST_P(CompactCorrupt, OverlongGap) {
  // Changes at 0 and 50 encoded for a 60-element tensor, decoded against a 40-element base.
  Corruptible c(GetParam());
  c.e = changes_at_0_and_50_of_60();
  c.f.meta[0].shape = {40};
  c.f.base[0].resize(80);
  EXPECT_REFUSED(c, "gap after position 0 leads outside the tensor (40 elements)");
}

TEST_P(CompactCorrupt, TrailingGarbage) {
  {  // a byte after the last block
    Corruptible c(GetParam());
    c.e.payload.push_back(0);
    c.set<uint64_t>(Corruptible::kHeaderPayload, c.e.payload.size());
    EXPECT_REFUSED(c, "trailing bytes");
  }
  {  // a byte claimed by the last block's raw bits
    Corruptible c(GetParam());
    const size_t last = c.record(c.blocks() - 1);
    c.e.payload.push_back(0);
    c.set<uint32_t>(last + Corruptible::kBits, c.get<uint32_t>(last + Corruptible::kBits) + 1);
    c.set<uint64_t>(Corruptible::kHeaderPayload, c.e.payload.size());
    EXPECT_REFUSED(c, "raw bit stream has trailing bytes");
  }
  {  // tables with a byte too many
    Corruptible c(GetParam());
    c.set<uint32_t>(c.record(0) + Corruptible::kTable, c.get<uint32_t>(c.record(0) + Corruptible::kTable) + 1);
    c.set<uint32_t>(c.record(0) + Corruptible::kRans, c.get<uint32_t>(c.record(0) + Corruptible::kRans) - 1);
    EXPECT_REFUSED(c, "block 0: ");
  }
}

TEST_P(CompactCorrupt, RandomByteFlipsNeverCrash) {
  // Every mutation must either decode (a flip in raw value bits is still a valid delta) or be
  // refused with an Error; run under ASan/UBSan this also proves no out-of-bounds access.
  Corruptible original(GetParam());
  std::mt19937_64 rng(2024);
  int refused = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    Corruptible& c = original;
    const auto saved_index = c.e.block_index;
    const auto saved_payload = c.e.payload;
    c.flip_random_bits(rng);
    compact::DecodedDelta decoded;
    const auto refs = c.f.base_refs();
    try {
      compact::decode(c.views(), c.f.meta, refs, "fuzz", decoded);
    } catch (const ds::Error&) {
      ++refused;
    }
    c.e.block_index = saved_index;
    c.e.payload = saved_payload;
  }
  EXPECT_GT(refused, 1500);
}
