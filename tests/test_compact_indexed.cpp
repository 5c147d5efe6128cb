// The compact indexed layout (compact_layout 2, codec/compact_indexed.hpp): written and read back
// it decodes to exactly what layout 1 decodes to, with the same promises; its header is one size
// whatever the number of tensors; the strict reader refuses a file for another tensor table and
// every structural defect in one line naming the file (and the tensor where there is one);
// layout 1 files stay readable.
#include <gtest/gtest.h>

#include <random>

#include "codec/compact_codec.hpp"
#include "codec/compact_indexed.hpp"
#include "codec/compact_table.hpp"
#include "codec/digest.hpp"
#include "compact_test_support.hpp"
#include "core/little_endian.hpp"
#include "engine/integrity.hpp"
#include "test_support.hpp"

using namespace deltasync;
using namespace compact_test;
namespace ix = compact::indexed;

namespace {

// A tiled model with changes and the digests a publisher records, serialized in `layout`.
struct Written {
  Model m;
  DeltaInfo info;
  compact::Options options;
  explicit Written(uint32_t layout = compact::kLayout2, bool digests = true) {
    std::mt19937_64 rng(3);
    m = tiled_model(DType::BF16, 0.05, rng);
    m.add("unchanged", DType::BF16, 64);  // no record
    m.encode();
    options.block_elements = 64;
    options.layout = layout;
    info.model_version = 7;
    info.base_version = 6;
    if (digests) {
      std::vector<uint64_t> base(m.meta.size());
      for (size_t t = 0; t < base.size(); ++t) base[t] = 1000 + t;
      integrity::put_delta_digests(info, integrity::delta_digests(m.meta, m.delta.view(), base, 7, 6));
    }
  }
  std::vector<uint8_t> bytes() const { return compact::serialize_compact_delta(m.meta, m.delta.view(), info, options); }
};

compact::DecodedDelta decode(const std::vector<uint8_t>& bytes, const Model& m, const std::vector<TensorMeta>& base_meta) {
  const st::File file = st::File::from_bytes(bytes, "d");
  compact::DecodedDelta out;
  compact::decode_compact_delta(file, base_meta, m.base_refs(), out);
  return out;
}

uint64_t header_bytes(std::span<const uint8_t> file) { return 8 + detail::load_le<uint64_t>(file.data()); }

// `bytes` with the data byte at `offset` of entry `name` changed by `edit`.
std::vector<uint8_t> with_data(std::vector<uint8_t> bytes, std::string_view name, uint64_t offset, const std::function<void(uint8_t&)>& edit) {
  const st::File file = st::File::from_bytes(bytes, "d");
  const st::TensorInfo& t = file.at(name);
  edit(bytes[header_bytes(bytes) + t.begin + offset]);
  return bytes;
}

std::string refusal(const std::vector<uint8_t>& bytes, const Model& m) {
  return error_message([&] { decode(bytes, m, m.meta); });
}

}  // namespace

TEST(CompactIndexed, DecodesToWhatLayout1DecodesToWithTheSamePromises) {
  const Written two, one(compact::kLayout1);
  const std::vector<uint8_t> a = two.bytes(), b = one.bytes();
  const st::File file = st::File::from_bytes(a, "d");
  EXPECT_EQ(file.metadata().at("compact_layout"), "2");
  EXPECT_EQ(file.tensors().size(), 5u);
  EXPECT_FALSE(file.metadata().contains("changed_params"));
  EXPECT_FALSE(file.metadata().contains("tensor_shapes"));
  EXPECT_FALSE(file.metadata().contains("base_digests"));
  const compact::DecodedDelta da = decode(a, two.m, two.m.meta), db = decode(b, one.m, one.m.meta);
  EXPECT_EQ(da.storage.offsets, db.storage.offsets);
  EXPECT_EQ(da.storage.indices, db.storage.indices);
  EXPECT_EQ(da.storage.values, db.storage.values);
  EXPECT_EQ(da.storage.base_values, db.storage.base_values);
  EXPECT_EQ(da.storage.indices, two.m.delta.indices);
  EXPECT_EQ(da.info.model_version, 7u);
  EXPECT_EQ(da.info.base_version, std::optional<uint64_t>(6));
  const auto pa = integrity::read_delta_digests(da.info, "a"), pb = integrity::read_delta_digests(db.info, "b");
  ASSERT_TRUE(pa && pb);
  EXPECT_EQ(pa->base, pb->base);
  EXPECT_EQ(pa->result, pb->result);
  EXPECT_EQ(pa->base.size(), 4u);  // the four changed tensors
  // A base model in another order is the same table.
  std::vector<TensorMeta> reversed(two.m.meta.rbegin(), two.m.meta.rend());
  Model m_rev = two.m;
  m_rev.meta = reversed;
  m_rev.base.assign(two.m.base.rbegin(), two.m.base.rend());
  const compact::DecodedDelta dr = decode(a, m_rev, reversed);
  EXPECT_EQ(dr.storage.offsets.back(), da.storage.offsets.back());
  // Without digests: none recorded, none read.
  const Written plain(compact::kLayout2, false);
  const compact::DecodedDelta dp = decode(plain.bytes(), plain.m, plain.m.meta);
  EXPECT_FALSE(integrity::read_delta_digests(dp.info, "p"));
}

TEST(CompactIndexed, TheHeaderIsOneSizeWhateverTheNumberOfTensors) {
  auto header_for = [](size_t tensors) {
    Model m;
    std::mt19937_64 rng(5);
    for (size_t t = 0; t < tensors; ++t) {
      m.add("model.layers." + std::to_string(t) + ".mlp.experts.weight", DType::BF16, 256);
      fill_base(m.base[t], 2, rng, false);
      make_changes(m, t, 0.05, Change::Ulp, rng);
    }
    m.encode();
    DeltaInfo info;
    std::vector<uint64_t> base(tensors, 1);
    integrity::put_delta_digests(info, integrity::delta_digests(m.meta, m.delta.view(), base, 2, 1));
    compact::Options options;
    options.layout = compact::kLayout2;
    const auto bytes = compact::serialize_compact_delta(m.meta, m.delta.view(), info, options);
    return header_bytes(bytes);
  };
  const uint64_t small = header_for(10), large = header_for(2000);
  EXPECT_LT(small, 2048u);
  EXPECT_LE(large, small + 64);  // only the decimal sizes grow
}

TEST(CompactIndexed, RefusesAnotherTensorTableBeforeReadingARecord) {
  const Written w;
  const std::vector<uint8_t> bytes = w.bytes();
  std::vector<TensorMeta> other = w.m.meta;
  other[1].shape = {4, 64, 24};  // same elements, another shape
  Model m2 = w.m;
  m2.meta = other;
  const std::string e = error_message([&] { decode(bytes, m2, other); });
  EXPECT_EQ(e.rfind("d: written for another tensor table (5 tensors, sha256 ", 0), 0u) << e;
  EXPECT_NE(e.find("names, dtypes or shapes differ"), std::string::npos) << e;
  std::vector<TensorMeta> fewer(w.m.meta.begin(), w.m.meta.end() - 1);
  Model m3 = w.m;
  m3.meta = fewer;
  m3.base.pop_back();
  EXPECT_NE(error_message([&] { decode(bytes, m3, fewer); }).find("written for another tensor table"), std::string::npos);
}

TEST(CompactIndexed, RefusesEveryStructuralDefectInOneLine) {
  const Written w;
  const std::vector<uint8_t> good = w.bytes();
  ASSERT_NO_THROW(decode(good, w.m, w.m.meta));
  const uint64_t T = w.m.meta.size();
  // A bit past the table's tensors (5 tensors: bits 5..7 of the one byte are padding).
  EXPECT_EQ(refusal(with_data(good, ix::kPresent, 0, [](uint8_t& b) { b |= 0x80; }), w.m),
            "d: presence bitmap sets bits past the table's " + std::to_string(T) + " tensors");
  // A bit for a tensor without a record (the unchanged one is ordinal 4 of 5: "unchanged" sorts last).
  EXPECT_EQ(refusal(with_data(good, ix::kPresent, 0, [](uint8_t& b) { b |= 0x10; }), w.m), "d: presence bitmap sets 5 bits for 4 records");
  // A record whose ordinal is not the bitmap's.
  EXPECT_EQ(refusal(with_data(good, ix::kRecords, ix::kRecordBytes, [](uint8_t& b) { b = 3; }), w.m),
            "d: record 1 has ordinal 3, the presence bitmap's 1th tensor is 1");
  // An entry that does not start where the previous one ends.
  EXPECT_EQ(refusal(with_data(good, ix::kRecords, ix::kRecordBytes + 8, [](uint8_t& b) { b ^= 1; }), w.m),
            "d: tensor mlp.w: its entry or payload is not where the records before it end");
  // An entry's size that disagrees with its block count.
  EXPECT_NE(refusal(with_data(good, ix::kRecords, 4, [](uint8_t& b) { b ^= 16; }), w.m).find("d: tensor experts.w: block index entry has"),
            std::string::npos);
  // A block count that disagrees with the entry's size.
  EXPECT_NE(refusal(with_data(good, ix::kIndex, 20, [](uint8_t& b) { b ^= 1; }), w.m).find("d: tensor experts.w: block index entry has"),
            std::string::npos);
  // A payload size in the block index beyond the payload section.
  EXPECT_EQ(refusal(with_data(good, ix::kIndex, 15, [](uint8_t& b) { b = 0x7f; }), w.m), "d: tensor experts.w: its payload runs past compact.payload");
  // A table of another size in the metadata is another table.
  const auto renamed = [&] {
    std::vector<uint8_t> bytes = good;
    const std::string needle = "\"compact_table_tensors\":\"5\"";
    const std::string text(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(header_bytes(bytes)));
    const size_t at = text.find(needle);
    EXPECT_NE(at, std::string::npos);
    bytes[at + needle.size() - 2] = '9';
    return bytes;
  }();
  EXPECT_NE(refusal(renamed, w.m).find("d: compact.present has 1 bytes for a table of 9 tensors"), std::string::npos);
}

TEST(CompactIndexed, Layout1FilesStayReadableAndTheOptionChoosesTheLayout) {
  const Written one(compact::kLayout1);
  const std::vector<uint8_t> bytes = one.bytes();
  const st::File file = st::File::from_bytes(bytes, "d");
  EXPECT_FALSE(file.metadata().contains("compact_layout"));
  EXPECT_TRUE(file.find("mlp.w.cindex"));
  EXPECT_EQ(decode(bytes, one.m, one.m.meta).storage.indices, one.m.delta.indices);
  compact::Options bad;
  bad.layout = 3;
  EXPECT_NE(error_message([&] { compact::serialize_compact_delta(one.m.meta, one.m.delta.view(), one.info, bad); }).find("unknown compact_layout 3"),
            std::string::npos);
}

TEST(CompactIndexed, PresenceRanksOrdinalsToRecordsAcrossWords) {
  std::vector<uint8_t> bitmap(20, 0);  // 160 tensors
  const std::vector<uint32_t> set = {0, 7, 8, 63, 64, 65, 130, 159};
  for (uint32_t o : set) bitmap[o / 8] |= static_cast<uint8_t>(1u << (o % 8));
  const ix::Presence p(bitmap, 160, "b");
  EXPECT_EQ(p.count(), set.size());
  for (size_t k = 0; k < set.size(); ++k) {
    EXPECT_TRUE(p.has(set[k]));
    EXPECT_EQ(p.record_of(set[k]), k) << set[k];
  }
  EXPECT_FALSE(p.has(1));
  EXPECT_EQ(error_message([&] { ix::Presence(std::span(bitmap).first(19), 160, "b"); }), "b: presence bitmap has 19 bytes for 160 tensors");
}

TEST(CompactIndexed, TheTableIsSortedByNameAndHashesNamesDtypesAndShapes) {
  const std::vector<TensorMeta> model = {{"b", DType::BF16, {4}}, {"a", DType::F32, {2, 2}}, {"c", DType::BF16, {1}}};
  const compact::TensorTable t(model);
  EXPECT_EQ(t.at(0).name, "a");
  EXPECT_EQ(t.model_index(0), 1u);
  EXPECT_EQ(t.ordinal("c"), std::optional<uint32_t>(2));
  EXPECT_FALSE(t.ordinal("d"));
  std::vector<TensorMeta> reshaped = model;
  reshaped[1].shape = {4};
  EXPECT_NE(compact::TensorTable(reshaped).sha256_hex(), t.sha256_hex());
  std::vector<TensorMeta> retyped = model;
  retyped[0].dtype = DType::F16;
  EXPECT_NE(compact::TensorTable(retyped).sha256_hex(), t.sha256_hex());
  const std::vector<TensorMeta> reordered = {model[2], model[0], model[1]};
  EXPECT_EQ(compact::TensorTable(reordered).sha256_hex(), t.sha256_hex());
  EXPECT_EQ(compact::TensorTable::of(model)->sha256_hex(), t.sha256_hex());
  EXPECT_EQ(compact::TensorTable::of(model), compact::TensorTable::of(model));  // kept while the model is equal
  EXPECT_NE(compact::TensorTable::of(reshaped)->sha256_hex(), t.sha256_hex());
  const std::vector<TensorMeta> twice = {model[0], model[0]};
  EXPECT_EQ(error_message([&] { compact::TensorTable{twice}; }), "tensor table: tensor b appears twice");
}
