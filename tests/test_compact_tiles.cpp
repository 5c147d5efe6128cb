// Tiles of the compact format (codec/compact_tiles.hpp): tensors cut into column bands x row
// stripes round-trip bit-exactly for every width, density, block size and compact version, in
// flat order for the verified apply; the block index records the tiles (index version 2) and no
// block crosses one; readers refuse malformed tiles and blocks that cross them in one line; and
// files written without tiles -- including the fuzz seeds committed before tiles existed -- stay
// readable.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "codec/compact_block_simd.hpp"
#include "codec/compact_block_subset.hpp"
#include "codec/compact_codec.hpp"
#include "codec/compact_tile_order.hpp"
#include "codec/compact_tile_order_simd.hpp"
#include "codec/compact_two_phase.hpp"
#include "compact_test_support.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "engine/cpu_engine.hpp"
#include "engine/cpu_sync_engine.hpp"
#include "engine/integrity.hpp"
#include "format/safetensors.hpp"
#include "fuzz/fuzz_model.hpp"

namespace ds = deltasync;
namespace compact = deltasync::compact;
using namespace compact_test;

namespace {

compact::Options options_for(uint32_t block, uint32_t version, uint32_t max_tiles = compact::kDefaultMaxTiles) {
  compact::Options o;
  o.block_elements = block;
  o.version = version;
  o.max_tiles = max_tiles;
  return o;
}

compact::BlockRecords records_of(const compact::EncodedTensor& e, const ds::TensorMeta& meta) {
  return compact::read_block_records(e.block_index, e.payload.size(), meta.shape, e.index_version, e.name);
}

// A decode's error message, or "" when it decoded.
std::string decode_error(const std::vector<compact::EncodedTensorView>& views, const Model& m) {
  compact::DecodedDelta decoded;
  const auto refs = m.base_refs();
  try {
    compact::decode(views, m.meta, refs, "d.safetensors", decoded);
  } catch (const ds::Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    EXPECT_EQ(what.rfind("d.safetensors: ", 0), 0u) << what;
    return what;
  }
  return "";
}

}  // namespace

TEST(CompactTiles, RoundTripInFlatOrderForEveryWidthDensityBlockAndVersion) {
  int tiled = 0, banded = 0;
  for (ds::DType dtype : {ds::DType::F8_E4M3, ds::DType::BF16, ds::DType::F32}) {
    for (double density : {0.005, 0.05, 0.4, 1.0}) {
      std::mt19937_64 rng(static_cast<uint64_t>(density * 1e4) + ds::dtype_width(dtype));
      Model m = tiled_model(dtype, density, rng);
      m.encode();
      for (uint32_t block : {1u, 7u, 16u, 64u, 16384u}) {
        for (uint32_t version : {compact::kFormatVersion1, compact::kFormatVersion2}) {
          SCOPED_TRACE(std::string(ds::dtype_name(dtype)) + " density " + std::to_string(density) + " block " +
                       std::to_string(block) + " version " + std::to_string(version));
          const compact::Options options = options_for(block, version);
          const auto encoded = compact::encode(m.meta, m.delta.view(), options);
          for (size_t i = 0, t = 0; i < encoded.size(); ++i, ++t) {
            while (m.meta[t].name != encoded[i].name) ++t;
            const compact::BlockRecords rec = records_of(encoded[i], m.meta[t]);
            const compact::TileGeometry want =
                compact::choose_tiles(m.meta[t].shape, m.delta.view().count(t), block, compact::kDefaultMaxTiles);
            EXPECT_EQ(rec.tiles.bands, want.bands) << encoded[i].name;
            EXPECT_EQ(rec.tiles.stripes, want.stripes) << encoded[i].name;
            tiled += want.tiles() > 1;
            banded += want.bands > 1;
          }
          compact::DecodedDelta decoded;
          const auto refs = m.base_refs();
          compact::decode(views_of(encoded), m.meta, refs, "mem", decoded, options);
          // Flat order, the encode's own arrays: what cpu::apply and the verified apply take.
          EXPECT_EQ(decoded.storage.indices, m.delta.indices);
          EXPECT_EQ(decoded.storage.values, m.delta.values);
          EXPECT_EQ(decoded.storage.base_values, m.delta.base_values);
          std::vector<std::vector<uint8_t>> target = m.base;
          std::vector<ds::TensorRef> targets;
          for (size_t t = 0; t < m.meta.size(); ++t)
            targets.push_back({m.meta[t].name, target[t].data(), m.meta[t].numel(), m.meta[t].width()});
          ds::cpu::apply(targets, decoded.patches(m.meta));
          EXPECT_EQ(target, m.current);
          // Serial and parallel encodes write the same bytes.
          compact::Options serial = options;
          serial.parallel = false;
          const auto again = compact::encode(m.meta, m.delta.view(), serial);
          ASSERT_EQ(again.size(), encoded.size());
          for (size_t i = 0; i < again.size(); ++i) {
            EXPECT_EQ(again[i].block_index, encoded[i].block_index);
            EXPECT_EQ(again[i].payload, encoded[i].payload);
          }
        }
      }
    }
  }
  EXPECT_GT(banded, 20);
  EXPECT_GT(tiled, banded);  // odd.w (75 columns) takes stripes only
}

TEST(CompactTiles, BlocksFollowTheCodedOrderTileByTile) {
  std::mt19937_64 rng(3);
  Model m = tiled_model(ds::DType::BF16, 0.1, rng);
  m.encode();
  const uint32_t block = 16;
  const auto encoded = compact::encode(m.meta, m.delta.view(), options_for(block, compact::kFormatVersion1));
  ASSERT_EQ(encoded.size(), m.meta.size());
  for (size_t t = 0; t < m.meta.size(); ++t) {
    SCOPED_TRACE(m.meta[t].name);
    const compact::BlockRecords rec = records_of(encoded[t], m.meta[t]);
    const uint64_t n = m.delta.view().count(t);
    const uint32_t w = m.meta[t].width();
    const compact::CodedOrder order = compact::to_coded_order(
        rec.tiles, std::span(m.delta.indices).subspan(m.delta.offsets[t], n),
        std::span(m.delta.values).subspan(m.delta.value_offsets[t], n * w),
        std::span(m.delta.base_values).subspan(m.delta.value_offsets[t], n * w), w);
    const std::vector<uint64_t> whole{0, n};
    const std::vector<uint64_t>& starts = rec.tiles.tiles() > 1 ? order.tile_starts : whole;
    // Every tile's changes in blocks of `block`, the last one short; each block's first position
    // is its first change's coded position.
    size_t b = 0;
    for (size_t tile = 0; tile + 1 < starts.size(); ++tile) {
      for (uint64_t first = starts[tile]; first < starts[tile + 1]; first += block, ++b) {
        ASSERT_LT(b, rec.blocks.size());
        EXPECT_EQ(rec.blocks[b].count, std::min<uint64_t>(block, starts[tile + 1] - first)) << "block " << b;
        const int64_t coded = order.positions.empty() ? m.delta.indices[m.delta.offsets[t] + first] : order.positions[first];
        EXPECT_EQ(rec.blocks[b].first_position, static_cast<uint64_t>(coded)) << "block " << b;
        EXPECT_EQ(rec.tiles.tile_of(rec.blocks[b].first_position), tile) << "block " << b;
      }
    }
    EXPECT_EQ(b, rec.blocks.size());
  }
}

TEST(CompactTiles, TheReorderingsAgreeWithTheGeometryChangeByChange) {
  // to_coded_order and to_flat_order against TileGeometry::coded/flat one change at a time (a
  // stable sort by coded position is the coded order): sparse stripes with empty rows and
  // bands, dense ones with long runs, a tensor that is all changes, every width.
  struct Case {
    uint64_t rows, cols;
    uint32_t bands, stripes;
    double density;
  };
  // The last: 2^33 elements, so flat positions need more than 32 bits (the AVX-512 walk then
  // moves 4-byte bits apart from the positions), its changes drawn rather than swept.
  const Case cases[] = {{64, 96, 8, 8, 0.003},   {64, 96, 8, 8, 0.05},      {64, 96, 2, 4, 0.6}, {40, 48, 4, 8, 1.0},
                        {256, 1024, 8, 8, 0.01}, {256, 1024, 8, 2, 0.15},   {8, 16, 8, 1, 0.5},
                        {uint64_t{1} << 21, 4096, 8, 8, 1e-5}};
  std::mt19937_64 rng(44);
  for (const Case& c : cases) {
    for (uint32_t w : {1u, 2u, 4u}) {
      SCOPED_TRACE(std::to_string(c.rows) + "x" + std::to_string(c.cols) + " " + std::to_string(c.bands) + "x" +
                   std::to_string(c.stripes) + " density " + std::to_string(c.density) + " width " + std::to_string(w));
      const compact::TileGeometry g{c.rows, c.cols, c.bands, c.stripes};
      std::vector<int64_t> flat;
      const uint64_t numel = c.rows * c.cols;
      if (numel <= uint64_t{1} << 24) {
        for (uint64_t p = 0; p < numel; ++p)
          if (std::uniform_real_distribution<double>(0, 1)(rng) < c.density) flat.push_back(static_cast<int64_t>(p));
      } else {
        for (uint64_t i = 0; i < static_cast<uint64_t>(c.density * static_cast<double>(numel)); ++i)
          flat.push_back(static_cast<int64_t>(rng() % numel));
        std::sort(flat.begin(), flat.end());
        flat.erase(std::unique(flat.begin(), flat.end()), flat.end());
      }
      const size_t n = flat.size();
      std::vector<uint8_t> new_bits(n * w), base_bits(n * w);
      for (auto& b : new_bits) b = static_cast<uint8_t>(rng());
      for (auto& b : base_bits) b = static_cast<uint8_t>(rng());
      // The reference: each change at its coded position, sorted.
      std::vector<size_t> by_coded(n);
      for (size_t i = 0; i < n; ++i) by_coded[i] = i;
      std::stable_sort(by_coded.begin(), by_coded.end(), [&](size_t a, size_t b) {
        return g.coded(static_cast<uint64_t>(flat[a])) < g.coded(static_cast<uint64_t>(flat[b]));
      });
      const compact::CodedOrder coded = compact::to_coded_order(g, flat, new_bits, base_bits, w);
      ASSERT_EQ(coded.positions.size(), n);
      for (size_t j = 0; j < n; ++j) {
        const size_t i = by_coded[j];
        ASSERT_EQ(static_cast<uint64_t>(coded.positions[j]), g.coded(static_cast<uint64_t>(flat[i]))) << "coded change " << j;
        ASSERT_EQ(std::memcmp(coded.new_bits.data() + j * w, new_bits.data() + i * w, w), 0) << "coded change " << j;
        ASSERT_EQ(std::memcmp(coded.base_bits.data() + j * w, base_bits.data() + i * w, w), 0) << "coded change " << j;
      }
      for (uint32_t t = 0; t < g.tiles(); ++t)
        for (uint64_t j = coded.tile_starts[t]; j < coded.tile_starts[t + 1]; ++j)
          ASSERT_EQ(g.tile_of(static_cast<uint64_t>(coded.positions[j])), t) << "coded change " << j;
      // And back: the bits as they are, then new bits decoded against zeros rebased onto a base.
      std::vector<int64_t> back(n);
      std::vector<uint8_t> back_new(n * w), back_base(n * w);
      compact::to_flat_order(g, {coded.positions, coded.new_bits, coded.base_bits}, w, back, back_new, back_base);
      EXPECT_EQ(back, flat);
      EXPECT_EQ(back_new, new_bits);
      EXPECT_EQ(back_base, base_bits);
      // New bits alone (what the unbased decode merges).
      std::fill(back.begin(), back.end(), -1);
      std::fill(back_new.begin(), back_new.end(), uint8_t{0});
      compact::to_flat_order(g, {coded.positions, coded.new_bits, {}}, w, back, back_new, {});
      EXPECT_EQ(back, flat);
      EXPECT_EQ(back_new, new_bits);
      if (numel > uint64_t{1} << 24) continue;  // no whole base to rebase onto
      std::vector<uint8_t> base(c.rows * c.cols * w), unbased(n * w);
      for (auto& b : base) b = static_cast<uint8_t>(rng());
      for (size_t j = 0; j < n; ++j) {  // what a block decoded against zeros leaves: the same difference over 0
        const uint32_t diff = compact::value_symbol(load(coded.new_bits, j, w), load(coded.base_bits, j, w), w);
        store(unbased, j, w, compact::apply_value_symbol(diff, 0, w));
      }
      compact::to_flat_order(g, {coded.positions, unbased, {}}, w, back, back_new, back_base, base.data());
      EXPECT_EQ(back, flat);
      for (size_t i = 0; i < n; ++i) {
        const uint32_t real = load(base, static_cast<uint64_t>(flat[i]), w);
        ASSERT_EQ(load(back_base, i, w), real) << "flat change " << i;
        const uint32_t diff = compact::value_symbol(load(new_bits, i, w), load(base_bits, i, w), w);
        ASSERT_EQ(load(back_new, i, w), compact::apply_value_symbol(diff, real, w)) << "flat change " << i;
      }
    }
  }
}

TEST(CompactTiles, UnbasedDecodingRebasesBandedTensorsLikeTheDirectDecode) {
  std::mt19937_64 rng(21);
  Model m = tiled_model(ds::DType::BF16, 0.05, rng);
  m.encode();
  const auto bytes = compact::serialize_compact_delta(m.meta, m.delta.view(), {}, options_for(16, compact::kFormatVersion2));
  const ds::st::File file = ds::st::File::from_bytes(bytes, "d");
  EXPECT_EQ(file.metadata().at("compact_index_version"), "2");
  compact::DecodedDelta unbased;
  compact::decode_compact_delta_unbased(file, m.meta, unbased);
  EXPECT_EQ(unbased.storage.indices, m.delta.indices);  // flat order without the base
  std::vector<uint8_t> rebased(unbased.storage.values.size());
  std::vector<uint8_t> base_bits;
  for (size_t t = 0; t < m.meta.size(); ++t)
    for (uint64_t i = m.delta.offsets[t]; i < m.delta.offsets[t + 1]; ++i) {
      const uint32_t w = m.meta[t].width();
      const auto* at = m.base[t].data() + static_cast<uint64_t>(m.delta.indices[i]) * w;
      base_bits.insert(base_bits.end(), at, at + w);
    }
  compact::rebase_values(unbased.storage.values, base_bits, 2, rebased);
  EXPECT_EQ(rebased, m.delta.values);
}

TEST(CompactTiles, ASubsetOfABandedTensorsBlocksDecodesToThoseChangesInFlatOrder) {
  std::mt19937_64 rng(8);
  Model m;
  m.add_shaped("w", ds::DType::BF16, {128, 64});
  fill_base(m.base[0], 2, rng, false);
  make_changes(m, 0, 0.2, Change::Ulp, rng);
  m.encode();
  const auto e = compact::encode(m.meta, m.delta.view(), options_for(32, compact::kFormatVersion1)).at(0);
  const compact::BlockRecords rec = records_of(e, m.meta[0]);
  ASSERT_GE(rec.tiles.bands, 2u);
  // The blocks of the right half of the columns (what a row-parallel rank 1 of 2 reads).
  std::vector<compact::ElementSpan> right;
  for (uint64_t r = 0; r < 128; ++r) right.push_back({r * 64 + 32, r * 64 + 64});
  const std::vector<uint32_t> chosen = compact::blocks_overlapping(rec, right);
  ASSERT_FALSE(chosen.empty());
  ASSERT_LT(chosen.size(), rec.blocks.size());
  std::vector<std::span<const uint8_t>> payloads;
  for (uint32_t b : chosen) payloads.push_back(std::span(e.payload).subspan(rec.blocks[b].payload_offset, rec.blocks[b].payload_bytes()));
  const compact::BlockSubset subset = compact::build_block_subset(rec, chosen, payloads, "w");
  compact::DecodedDelta decoded;
  const auto refs = m.base_refs();
  const std::vector<compact::EncodedTensorView> views{{"w", subset.block_index, subset.payload, e.version, e.index_version}};
  compact::decode(views, m.meta, refs, "subset", decoded);
  std::vector<int64_t> want;
  for (const int64_t p : m.delta.indices)
    if (p % 64 >= 32) want.push_back(p);
  EXPECT_EQ(decoded.storage.indices, want);
}

TEST(CompactTiles, ReadersRefuseMalformedTilesAndCrossingBlocksInOneLine) {
  std::mt19937_64 rng(17);
  Model m = tiled_model(ds::DType::BF16, 0.05, rng);
  m.encode();
  const auto encoded = compact::encode(m.meta, m.delta.view(), options_for(16, compact::kFormatVersion1));
  ASSERT_EQ(encoded.size(), 4u);  // mlp.w, experts.w, norm, odd.w
  EXPECT_EQ(decode_error(views_of(encoded), m), "");
  auto edited = [&](size_t i, auto edit) {
    std::vector<compact::EncodedTensor> copy = encoded;
    EditableTensor t{copy[i]};
    edit(t);
    copy[i] = t.e;
    return decode_error(views_of(copy), m);
  };
  using T = EditableTensor;
  EXPECT_EQ(edited(0, [](T& t) { t.set<uint32_t>(T::kHeaderBands, 3); }),
            "d.safetensors: tensor mlp.w: block index: bands 3 and stripes " +
                std::to_string(EditableTensor{encoded[0]}.get<uint32_t>(T::kHeaderStripes)) + " are not 1, 2, 4 or 8 (shape [192, 96])");
  EXPECT_NE(edited(0, [](T& t) { t.set<uint32_t>(T::kHeaderStripes, 16); }).find("are not 1, 2, 4 or 8"), std::string::npos);
  EXPECT_EQ(edited(3, [](T& t) { t.set<uint32_t>(T::kHeaderBands, 2); }),
            "d.safetensors: tensor odd.w: block index: 2 bands do not divide 75 columns (shape [64, 75])");
  EXPECT_EQ(edited(2, [](T& t) { t.set<uint32_t>(T::kHeaderStripes, 2); }),
            "d.safetensors: tensor norm: block index: 1 x 2 tiles for a tensor of fewer than 2 dimensions (shape [300])");
  // Tiles the blocks were not cut by: more stripes than the writer cut make a block cross one.
  {
    std::vector<compact::EncodedTensor> coarse = compact::encode(m.meta, m.delta.view(), options_for(64, compact::kFormatVersion1));
    const compact::BlockRecords odd = records_of(coarse[3], m.meta[3]);
    ASSERT_EQ(odd.tiles.bands, 1u);
    ASSERT_LT(odd.tiles.stripes, 8u);
    EditableTensor t{coarse[3]};
    t.set<uint32_t>(T::kHeaderStripes, odd.tiles.stripes * 2);
    coarse[3] = t.e;
    const std::string crossing = decode_error(views_of(coarse), m);
    EXPECT_NE(crossing.find("d.safetensors: tensor odd.w: block "), std::string::npos) << crossing;
    EXPECT_NE(crossing.find(" crosses a tile boundary (positions "), std::string::npos) << crossing;
  }
  // The same for a tensor cut into column bands (decoded stripe by stripe, merged afterwards):
  // twice the bands it was cut into make blocks cross a band, refused before any merge.
  {
    std::vector<compact::EncodedTensor> coarse = compact::encode(m.meta, m.delta.view(), options_for(64, compact::kFormatVersion2));
    const compact::BlockRecords mlp = records_of(coarse[0], m.meta[0]);
    ASSERT_EQ(mlp.tiles.bands, 2u);
    EditableTensor t{coarse[0]};
    t.set<uint32_t>(T::kHeaderBands, 4);
    coarse[0] = t.e;
    const std::string crossing = decode_error(views_of(coarse), m);
    EXPECT_NE(crossing.find("d.safetensors: tensor mlp.w: block "), std::string::npos) << crossing;
    EXPECT_NE(crossing.find(" crosses a tile boundary (positions "), std::string::npos) << crossing;
  }

  // In a file of either container layout: an unknown compact_index_version, and version 2
  // indexes labelled version 1 (their size then disagrees with their block count).
  for (const uint32_t layout : {compact::kLayout1, compact::kLayout2}) {
    SCOPED_TRACE("compact_layout " + std::to_string(layout));
    compact::Options options = options_for(16, compact::kFormatVersion1);
    options.layout = layout;
    const ds::st::File file = ds::st::File::from_bytes(compact::serialize_compact_delta(m.meta, m.delta.view(), {}, options), "d.safetensors");
    auto relabelled = [&](const char* index_version) {
      std::vector<ds::st::WriteTensor> tensors;
      for (const ds::st::TensorInfo& t : file.tensors()) tensors.push_back({t.name, t.dtype, t.shape, file.bytes(t)});
      ds::st::Metadata md = file.metadata();
      if (index_version) md["compact_index_version"] = index_version; else md.erase("compact_index_version");
      const ds::st::File f = ds::st::File::from_bytes(ds::st::serialize(tensors, md), "d.safetensors");
      compact::DecodedDelta decoded;
      const auto refs = m.base_refs();
      try {
        compact::decode_compact_delta(f, m.meta, refs, decoded);
      } catch (const ds::Error& e) {
        return std::string(e.what());
      }
      return std::string("decoded");
    };
    EXPECT_EQ(relabelled("2"), "decoded");
    EXPECT_EQ(relabelled("3"), "d.safetensors: unsupported compact_index_version '3' (this build reads 1 and 2)");
    EXPECT_NE(relabelled(nullptr).find(layout == compact::kLayout1 ? "block index has" : "block index entry has"), std::string::npos);
  }
}

TEST(CompactTiles, FilesWithoutTilesStayReadableAndUnchanged) {
  // max_tiles = 1 in container layout 1 writes what writers wrote before tiles: no
  // compact_index_version, 24-byte headers.
  std::mt19937_64 rng(4);
  Model m = tiled_model(ds::DType::BF16, 0.05, rng);
  m.encode();
  compact::Options before_tiles = options_for(16, compact::kFormatVersion1, 1);
  before_tiles.layout = compact::kLayout1;
  const ds::st::File file = ds::st::File::from_bytes(compact::serialize_compact_delta(m.meta, m.delta.view(), {}, before_tiles), "old");
  EXPECT_FALSE(file.metadata().contains("compact_index_version"));
  const auto& e = file.at("mlp.w.cindex");
  EXPECT_EQ((file.bytes(e).size() - compact::kIndexHeaderBytes) % compact::kRecordBytes, 0u);
  compact::DecodedDelta decoded;
  const auto refs = m.base_refs();
  compact::decode_compact_delta(file, m.meta, refs, decoded);
  EXPECT_EQ(decoded.storage.indices, m.delta.indices);

  // The compact fuzz seeds committed before tiles existed (scripts/fuzz --seeds writes them
  // again byte for byte: fuzz::seed_delta keeps max_tiles = 1) decode to the fuzz model's next version.
  const ds::HostModel base = ds::fuzz::base_model(), next = ds::fuzz::next_model();
  for (const char* seed : {"delta-compact.safetensors", "delta-compact-v2.safetensors", "delta-compact-tiled.safetensors"}) {
    SCOPED_TRACE(seed);
    const std::filesystem::path path = std::filesystem::path(DELTASYNC_SOURCE_DIR) / "tests/fuzz/corpus/delta_apply" / seed;
    std::ifstream in(path, std::ios::binary);
    ASSERT_TRUE(in) << path;
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), {});
    const ds::st::File seed_file = ds::st::File::from_bytes(std::move(bytes), seed);
    compact::DecodedDelta d;
    const auto patches = compact::decode_compact_delta(seed_file, base.tensors, base.const_refs(), d);
    std::vector<std::vector<uint8_t>> target = base.data;
    std::vector<ds::TensorRef> targets;
    for (size_t t = 0; t < base.tensors.size(); ++t)
      targets.push_back({base.tensors[t].name, target[t].data(), base.tensors[t].numel(), base.tensors[t].width()});
    ds::cpu::apply(targets, patches);
    EXPECT_EQ(target, next.data);
  }
}

// Through the engine's verified, transactional apply: a tiled delta brings the weights to the
// new version; the same delta with a block that crosses a tile is refused in one line, every
// weight and digest as it was.
TEST(CompactTiles, TheVerifiedApplyTakesTiledDeltasAndRefusesABadOneWritingNothing) {
  std::mt19937_64 rng(31);
  Model m = tiled_model(ds::DType::BF16, 0.05, rng);
  m.encode();
  const std::vector<uint64_t> base_digests = ds::digest_tensors(m.base_refs());
  ds::DeltaInfo info;
  ds::integrity::put_delta_digests(info, ds::integrity::delta_digests(m.meta, m.delta.view(), base_digests, 2, 1));
  auto encoded = compact::encode(m.meta, m.delta.view(), options_for(64, compact::kFormatVersion1));
  const auto good = compact::serialize_compact_delta(m.meta, m.delta.view(), info, encoded, options_for(64, compact::kFormatVersion1));
  // odd.w (stripes only) with twice the stripes its blocks were cut by.
  const compact::BlockRecords odd = records_of(encoded[3], m.meta[3]);
  ASSERT_LT(odd.tiles.stripes, 8u);
  EditableTensor t{encoded[3]};
  t.set<uint32_t>(EditableTensor::kHeaderStripes, odd.tiles.stripes * 2);
  encoded[3] = t.e;
  const auto bad = compact::serialize_compact_delta(m.meta, m.delta.view(), info, encoded, options_for(64, compact::kFormatVersion1));

  ds::engine::CpuSyncEngine engine;
  auto apply = [&](const std::vector<uint8_t>& bytes, std::vector<std::vector<uint8_t>>& weights, std::vector<uint64_t>& digests) {
    const ds::st::File file = ds::st::File::from_bytes(bytes, "d.safetensors");
    std::vector<ds::TensorRef> targets;
    for (size_t i = 0; i < m.meta.size(); ++i) targets.push_back({m.meta[i].name, weights[i].data(), m.meta[i].numel(), m.meta[i].width()});
    ds::engine::TransferCounters transfer;
    engine.apply({&file, 2, 1}, m.meta, targets, digests, 1, transfer);
  };
  std::vector<std::vector<uint8_t>> weights = m.base;
  std::vector<uint64_t> digests = base_digests;
  try {
    apply(bad, weights, digests);
    FAIL() << "a block crossing a tile was applied";
  } catch (const ds::Error& e) {
    EXPECT_NE(std::string(e.what()).find("d.safetensors: tensor odd.w: block "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(" crosses a tile boundary"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
  }
  EXPECT_EQ(weights, m.base);
  EXPECT_EQ(digests, base_digests);
  apply(good, weights, digests);
  EXPECT_EQ(weights, m.current);
  EXPECT_EQ(digests, ds::digest_tensors([&] {
    std::vector<ds::ConstTensorRef> refs;
    for (size_t i = 0; i < m.meta.size(); ++i) refs.push_back({m.meta[i].name, m.current[i].data(), m.meta[i].numel(), m.meta[i].width()});
    return refs;
  }()));
}

TEST(CompactTiles, SimdBandsAndCodedPositionsMatchTheGeometry) {
  // The encoder's AVX-512 first pass (compact_tile_order_simd.hpp) divides by the band width with
  // a double multiply and corrects it: against TileGeometry::coded at remainders 0 and
  // band_width - 1 (where a rounded quotient is off by one) up to its 2^40 limit, for band
  // widths that are and are not powers of two.
  if (!compact::detail::simd_blocks_supported()) GTEST_SKIP() << "no AVX-512 on this CPU, or DELTASYNC_CODEC_SIMD asks for less";
  const auto check = [](const compact::TileGeometry& g, const std::vector<int64_t>& positions) {
    std::vector<uint8_t> band(positions.size());
    std::vector<int64_t> coded(positions.size());
    compact::detail::band_and_coded8(positions.data(), positions.size(), g.bands, g.band_width(), g.band_elements(), band.data(),
                                     coded.data());
    for (size_t j = 0; j < positions.size(); ++j) {
      const auto p = static_cast<uint64_t>(positions[j]);
      ASSERT_EQ(static_cast<uint64_t>(coded[j]), g.coded(p)) << "cols " << g.cols << " bands " << g.bands << " position " << p;
      ASSERT_EQ(band[j], p % g.cols / g.band_width()) << "cols " << g.cols << " bands " << g.bands << " position " << p;
    }
  };
  std::mt19937_64 rng(9);
  for (const uint64_t cols : {uint64_t{1024}, uint64_t{8 * 151937}, uint64_t{2 * 3}, uint64_t{4 * 1000003}})
    for (const uint32_t bands : {2u, 4u, 8u}) {
      if (cols % bands != 0) continue;
      const uint64_t rows = compact::detail::kSimdSplitLimit / cols;
      const compact::TileGeometry g{rows, cols, bands, 1};
      const uint64_t bw = g.band_width();
      // Every row band u of a run of them below the limit and of a random stretch, at both
      // remainders; random positions.
      std::vector<int64_t> positions;
      const uint64_t stretch = rng() % (rows * bands - 20000);
      for (uint64_t u = 0; u < 20000; ++u)
        for (const uint64_t at : {rows * bands - 1 - u, stretch + u}) {
          positions.push_back(static_cast<int64_t>(at * bw));
          positions.push_back(static_cast<int64_t>(at * bw + bw - 1));
        }
      for (int i = 0; i < 4096; ++i) positions.push_back(static_cast<int64_t>(rng() % (rows * cols)));
      positions.push_back(static_cast<int64_t>(rows * cols - 1));
      while (positions.size() % 8 != 0) positions.push_back(0);
      check(g, positions);
    }
  // Band widths and row bands u whose position u * band_width the double multiply puts just
  // below u (found by search): only the correction gets them right.
  const std::pair<uint64_t, uint64_t> rounded_down[] = {{3982056, 195067}, {3807382, 199238}, {3773620, 241704},
                                                        {3065745, 108957}, {4182011, 55657},  {1982983, 236483}};
  for (const auto& [bw, u] : rounded_down) {
    const compact::TileGeometry g{compact::detail::kSimdSplitLimit / (2 * bw), 2 * bw, 2, 1};
    std::vector<int64_t> positions(8, static_cast<int64_t>(u * bw));
    check(g, positions);
  }
}
