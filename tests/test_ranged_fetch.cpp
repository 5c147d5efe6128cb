// Ranged reads of a delta by a receiver that holds only part of the model: the compact block
// subset, the planner (chunks, coalescing, overlap), sealed headers and chunk hashes, and two
// receivers on two ranks (threads), each holding half of every tensor, that read less than the
// whole delta and end bit-identical, and refuse a tampered block together.
#include <gtest/gtest.h>

#include <barrier>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>
#include <variant>
#include <array>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>

#include "codec/compact_block_subset.hpp"
#include "codec/compact_codec.hpp"
#include "codec/compact_indexed.hpp"
#include "core/little_endian.hpp"
#include "engine/integrity.hpp"
#include "compact_test_support.hpp"
#include "engine/cpu_sync_engine.hpp"
#include "format/sha256.hpp"
#include "sync/mapped_receiver.hpp"
#include "sync/publisher.hpp"
#include "sync/range_hashes.hpp"
#include "sync/ranged_fetch.hpp"
#include "sync/ranged_plan.hpp"
#include "sync/shard_publish.hpp"
#include "sync/subscriber.hpp"
#include "test_support.hpp"

using namespace deltasync;
using namespace compact_test;
using compact::ElementSpan;
using ranged::ByteRange;

namespace {

// One 1-D BF16 tensor of `numel` elements with changes at `density`, encoded in blocks of 64.
struct Encoded {
  Model m;
  std::vector<compact::EncodedTensor> enc;
  compact::Options options;
  explicit Encoded(uint64_t numel = 20000, double density = 0.05) {
    std::mt19937_64 rng(7);
    m.add("w", DType::BF16, numel);
    fill_base(m.base[0], 2, rng, false);
    make_changes(m, 0, density, Change::Ulp, rng);
    m.encode();
    options.block_elements = 64;
    enc = compact::encode(m.meta, m.delta.view(), options);
  }
  compact::BlockRecords records() const {
    return compact::read_block_records(enc[0].block_index, enc[0].payload.size(), m.meta[0].shape, enc[0].index_version, "w");
  }
};

// The records of blocks starting at `firsts` in a tensor of `rows` x `cols` cut into tiles.
compact::BlockRecords blocks_at(std::initializer_list<uint64_t> firsts, uint64_t rows, uint64_t cols, uint32_t bands = 1,
                                uint32_t stripes = 1) {
  compact::BlockRecords out;
  out.index_version = compact::kIndexVersion2;
  out.tiles = compact::TileGeometry{rows, cols, bands, stripes};
  for (uint64_t f : firsts) out.blocks.push_back(compact::BlockRecord{f, 0, 1, 0, 0, 0});
  return out;
}

// Chunk ends of `size`-byte chunks over `data` bytes (what objects sealed before had).
std::vector<uint64_t> fixed_ends(uint64_t size, uint64_t data) {
  std::vector<uint64_t> out;
  for (uint64_t at = size; at < data + size; at += size) out.push_back(std::min(at, data));
  return out;
}

}  // namespace

TEST(BlockSubset, AnySubsetOfBlocksDecodesToExactlyThoseBlocksChanges) {
  Encoded e;
  const compact::BlockRecords rec = e.records();
  ASSERT_GT(rec.blocks.size(), 6u);
  const std::vector<uint32_t> chosen = {1, 2, 5, static_cast<uint32_t>(rec.blocks.size() - 1)};
  std::vector<std::span<const uint8_t>> payloads;
  for (uint32_t b : chosen)
    payloads.push_back(std::span<const uint8_t>(e.enc[0].payload).subspan(rec.blocks[b].payload_offset, rec.blocks[b].payload_bytes()));
  const compact::BlockSubset subset = compact::build_block_subset(rec, chosen, payloads, "w");

  const std::vector<compact::EncodedTensorView> views = {
      {"w", subset.block_index, subset.payload, e.enc[0].version, e.enc[0].index_version}};
  compact::DecodedDelta decoded;
  compact::decode(views, e.m.meta, e.m.base_refs(), "subset", decoded, e.options);
  // The changes of the chosen blocks, in order: block b holds changes [64 b, 64 b + count).
  std::vector<int64_t> want_positions;
  std::vector<uint8_t> want_values;
  for (uint32_t b : chosen)
    for (uint64_t i = uint64_t{b} * 64; i < uint64_t{b} * 64 + rec.blocks[b].count; ++i) {
      want_positions.push_back(e.m.delta.indices[i]);
      want_values.insert(want_values.end(), e.m.delta.values.begin() + 2 * i, e.m.delta.values.begin() + 2 * i + 2);
    }
  EXPECT_EQ(subset.changed, want_positions.size());
  EXPECT_EQ(decoded.storage.indices, want_positions);
  EXPECT_EQ(decoded.storage.values, want_values);
}

TEST(BlockSubset, RefusesAPayloadOfTheWrongSizeAChoiceOutOfOrderAndABadIndex) {
  Encoded e;
  const compact::BlockRecords rec = e.records();
  auto payload = [&](uint32_t b) {
    return std::span<const uint8_t>(e.enc[0].payload).subspan(rec.blocks[b].payload_offset, rec.blocks[b].payload_bytes());
  };
  const std::vector<uint64_t>& shape = e.m.meta[0].shape;
  const uint32_t iv = e.enc[0].index_version;
  {
    const std::vector<uint32_t> chosen = {2};
    const std::vector<std::span<const uint8_t>> short_payload = {payload(2).first(payload(2).size() - 1)};
    EXPECT_NE(error_message([&] { compact::build_block_subset(rec, chosen, short_payload, "f: tensor w"); })
                  .find("f: tensor w: block 2: payload has"),
              std::string::npos);
  }
  {
    const std::vector<uint32_t> chosen = {3, 1};
    const std::vector<std::span<const uint8_t>> p = {payload(3), payload(1)};
    EXPECT_NE(error_message([&] { compact::build_block_subset(rec, chosen, p, "w"); }).find("out of order"), std::string::npos);
  }
  std::vector<uint8_t> truncated(e.enc[0].block_index.begin(), e.enc[0].block_index.end() - 1);
  EXPECT_NE(error_message([&] { compact::read_block_records(truncated, e.enc[0].payload.size(), shape, iv, "f: tensor w"); })
                .find("f: tensor w: block index has"),
            std::string::npos);
  EXPECT_NE(error_message([&] { compact::read_block_records(e.enc[0].block_index, e.enc[0].payload.size() + 1, shape, iv, "w"); })
                .find("payload has"),
            std::string::npos);
  const std::vector<uint64_t> ten{10};
  EXPECT_NE(error_message([&] { compact::read_block_records(e.enc[0].block_index, e.enc[0].payload.size(), ten, iv, "w"); })
                .find("outside the tensor"),
            std::string::npos);
}

TEST(BlockSubset, ABlockIsNeededWhenItsPositionSpanMeetsANeededSpan) {
  const auto blocks = blocks_at({0, 100, 200}, 1, 300);  // spans [0,100) [100,200) [200,300)
  auto pick = [&](std::vector<ElementSpan> needed) { return compact::blocks_overlapping(blocks, needed); };
  EXPECT_EQ(pick({}), std::vector<uint32_t>{});
  EXPECT_EQ(pick({{150, 160}}), std::vector<uint32_t>{1});
  EXPECT_EQ(pick({{99, 100}}), std::vector<uint32_t>{0});
  EXPECT_EQ(pick({{100, 101}}), std::vector<uint32_t>{1});
  EXPECT_EQ(pick({{99, 101}}), (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(pick({{0, 10}, {250, 300}}), (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(pick({{0, 300}}), (std::vector<uint32_t>{0, 1, 2}));
}

// ---- tiles ------------------------------------------------------------------------------------

TEST(Tiles, CodedPositionsRunBandByBandAndSpansFollowThem) {
  // A [4, 8] tensor in 2 bands of 4 columns: band 0 holds coded positions 0..15, band 1 16..31.
  const compact::TileGeometry g{4, 8, 2, 1};
  std::set<uint64_t> coded;
  for (uint64_t p = 0; p < 32; ++p) {
    EXPECT_EQ(g.flat(g.coded(p)), p);
    coded.insert(g.coded(p));
  }
  EXPECT_EQ(coded.size(), 32u);
  EXPECT_EQ(g.coded(5), 17u);   // row 0, column 5: band 1, its row 0, column 1
  EXPECT_EQ(g.coded(10), 6u);   // row 1, column 2: band 0, row 1
  using Spans = std::vector<ElementSpan>;
  EXPECT_EQ(compact::coded_spans(g, Spans{{10, 14}}), (Spans{{6, 8}, {20, 22}}));  // row 1, columns 2..5
  EXPECT_EQ(compact::coded_spans(g, Spans{{8, 24}}), (Spans{{4, 12}, {20, 28}}));  // rows 1 and 2
  EXPECT_EQ(compact::coded_spans(g, Spans{{6, 27}}), (Spans{{4, 15}, {18, 28}}));  // partial, whole, partial rows
  Spans right_half;  // what a row-parallel rank 1 of 2 holds: band 1 whole
  for (uint64_t r = 0; r < 4; ++r) right_half.push_back({r * 8 + 4, r * 8 + 8});
  EXPECT_EQ(compact::coded_spans(g, right_half), (Spans{{16, 32}}));
  const compact::TileGeometry untiled{4, 8, 1, 2};  // stripes alone move nothing
  EXPECT_EQ(compact::coded_spans(untiled, right_half), right_half);
}

TEST(Tiles, ABlockIsNeededOnlyWhereItsTileMeetsTheNeededElements) {
  // [4, 8] in 2 bands x 2 stripes: tiles are coded [0,8) [8,16) [16,24) [24,32); a block's span
  // ends at its tile's end, not at the next block.
  const auto blocks = blocks_at({1, 9, 17, 26}, 4, 8, 2, 2);
  auto pick = [&](std::vector<ElementSpan> needed) { return compact::blocks_overlapping(blocks, needed); };
  EXPECT_EQ(pick({{8, 16}}), (std::vector<uint32_t>{0, 2}));   // row 1: stripe 0 of both bands
  EXPECT_EQ(pick({{16, 32}}), (std::vector<uint32_t>{1, 3}));  // rows 2-3: stripe 1
  std::vector<ElementSpan> right_half;
  for (uint64_t r = 0; r < 4; ++r) right_half.push_back({r * 8 + 4, r * 8 + 8});
  EXPECT_EQ(pick(right_half), (std::vector<uint32_t>{2, 3}));  // columns 4-7: band 1
  EXPECT_EQ(pick({{0, 1}}), std::vector<uint32_t>{});            // before block 0's first change
}

TEST(Tiles, WritersCutATensorIntoTilesOfAtLeastABlockEachBandsAndStripesTogether) {
  using Shape = std::vector<uint64_t>;
  auto tiles = [](Shape shape, uint64_t changed, uint32_t block, uint32_t max_tiles = 8) {
    const compact::TileGeometry g = compact::choose_tiles(shape, changed, block, max_tiles);
    return std::to_string(g.bands) + "x" + std::to_string(g.stripes);
  };
  EXPECT_EQ(tiles({1024, 1024}, 10000, 2048), "2x2");       // 4 tiles of >= 2048 changes
  EXPECT_EQ(tiles({1024, 1024}, 8191, 2048), "1x1");        // 3.99 blocks: not 4 tiles
  EXPECT_EQ(tiles({1024, 1024}, 16384, 16384), "2x2");      // blocks above 4096: tiles of 4096 changes
  EXPECT_EQ(tiles({151936, 1024}, 1500000, 2048), "8x8");   // at most 8 per dimension
  EXPECT_EQ(tiles({3, 1024}, 1000000, 2048), "8x1");        // 3 rows: no stripes, bands go on alone
  EXPECT_EQ(tiles({1 << 20}, 1000000, 2048), "1x1");        // one dimension: one tile
  EXPECT_EQ(tiles({4, 2, 64}, 1000000, 16), "8x8");         // rows = 4 x 2
  EXPECT_EQ(tiles({4, 2, 64}, 1000000, 16, 4), "4x4");      // at most max_tiles per dimension
  EXPECT_EQ(tiles({1024, 1024}, 1000000, 2048, 1), "1x1");
  EXPECT_FALSE(compact::tiles_unfit(Shape{8, 8}, 8, 8));
  EXPECT_TRUE(compact::tiles_unfit(Shape{8, 8}, 3, 1));
  EXPECT_TRUE(compact::tiles_unfit(Shape{6, 8}, 1, 4));
  EXPECT_TRUE(compact::tiles_unfit(Shape{64}, 2, 1));
}

TEST(RangedPlan, RangesRoundOutToWholeChunksAndTouchingOnesMerge) {
  EXPECT_EQ(ranged::whole_chunks({{4096 + 5, 10}, {0, 10}, {8192, 1}}, fixed_ends(4096, 10000)), (std::vector<ByteRange>{{0, 10000}}));
  EXPECT_EQ(ranged::whole_chunks({{0, 10}, {12288, 5}}, fixed_ends(4096, 20000)), (std::vector<ByteRange>{{0, 4096}, {12288, 4096}}));
  EXPECT_EQ(ranged::whole_chunks({{100, 0}}, fixed_ends(4096, 20000)), std::vector<ByteRange>{});
  EXPECT_EQ(ranged::whole_chunks({{19990, 10}}, fixed_ends(4096, 20000)), (std::vector<ByteRange>{{16384, 3616}}));
  EXPECT_NE(error_message([] { ranged::whole_chunks({{19990, 11}}, fixed_ends(4096, 20000)); }).find("runs past"), std::string::npos);
  // Chunks of any sizes (objects sealed with range_chunk_sizes): [0,30) [30,31) [31,100) [100,400).
  const std::vector<uint64_t> ends{30, 31, 100, 400};
  EXPECT_EQ(ranged::whole_chunks({{30, 1}}, ends), (std::vector<ByteRange>{{30, 1}}));
  EXPECT_EQ(ranged::whole_chunks({{29, 2}}, ends), (std::vector<ByteRange>{{0, 31}}));
  EXPECT_EQ(ranged::whole_chunks({{31, 69}, {150, 1}}, ends), (std::vector<ByteRange>{{31, 369}}));
  EXPECT_EQ(ranged::whole_chunks({{99, 1}}, ends), (std::vector<ByteRange>{{31, 69}}));
}

TEST(RangedPlan, SpansMergeAndPlacementsOverlapOnlyWhereTheirRunsDo) {
  EXPECT_EQ(ranged::merge_spans({{5, 9}, {0, 3}, {3, 4}, {8, 12}, {20, 20}}), (std::vector<ElementSpan>{{0, 4}, {5, 12}}));
  // Shard(1) of a [4, 6] tensor, columns 3..5: runs [3,6) [9,12) [15,18) [21,24).
  const Placement cols{3, 3, 6, 4};
  auto meets = [&](std::vector<ElementSpan> s) { return ranged::placement_overlaps(cols, s); };
  EXPECT_FALSE(meets({{0, 3}}));
  EXPECT_TRUE(meets({{3, 4}}));
  EXPECT_FALSE(meets({{6, 9}, {12, 15}}));
  EXPECT_TRUE(meets({{6, 9}, {11, 12}}));
  EXPECT_FALSE(meets({{24, 100}}));
  EXPECT_FALSE(ranged::placement_overlaps(Placement{}, std::vector<ElementSpan>{{0, 100}}));
}

// ---- sealed objects -------------------------------------------------------------------------

namespace {

// `file` (a safetensors file) with its header's metadata changed by `edit`, data unchanged.
std::vector<uint8_t> reseal_metadata(std::span<const uint8_t> file, const std::function<void(nlohmann::ordered_json&)>& edit) {
  const uint64_t prefix = ranged::header_prefix_bytes(file, file.size(), "f");
  auto header = nlohmann::ordered_json::parse(file.begin() + 8, file.begin() + static_cast<std::ptrdiff_t>(prefix));
  edit(header["__metadata__"]);
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::vector<uint8_t> out(8 + text.size());
  for (int b = 0; b < 8; ++b) out[b] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * b));
  std::copy(text.begin(), text.end(), out.begin() + 8);
  out.insert(out.end(), file.begin() + static_cast<std::ptrdiff_t>(prefix), file.end());
  return out;
}

// A sealed object as publishers wrote them before chunks followed the layout: range_chunk_bytes
// and the hashes of fixed-size chunks.
std::vector<uint8_t> seal_with_one_chunk_size(std::span<const uint8_t> sealed, uint64_t chunk_bytes) {
  const uint64_t prefix = ranged::header_prefix_bytes(sealed, sealed.size(), "f");
  const std::span<const uint8_t> data = sealed.subspan(prefix);
  std::string hashes;
  for (uint64_t at = 0; at < data.size(); at += chunk_bytes) {
    const auto full = sha256(data.subspan(at, std::min<uint64_t>(chunk_bytes, data.size() - at)));
    hashes += to_hex(std::span<const uint8_t>(full).first(ranged::kChunkHashBytes));
  }
  return reseal_metadata(sealed, [&](nlohmann::ordered_json& md) {
    md.erase(ranged::kChunkSizesKey);
    md[ranged::kChunkBytesKey] = std::to_string(chunk_bytes);
    md[ranged::kChunkSha256Key] = hashes;
  });
}

// A sealed compact delta of Encoded's tensor in container layout 1 (the indexed layout needs no
// chunks: its tests are below), as the publisher writes it, with its reference.
struct Sealed {
  Encoded e;
  std::vector<uint8_t> bytes;
  protocol::ObjectRef ref;
  explicit Sealed(uint64_t numel = 20000) : e(numel) {
    DeltaInfo info;
    info.model_version = 2;
    e.options.layout = compact::kLayout1;
    const auto file = compact::serialize_compact_delta(e.m.meta, e.m.delta.view(), info, e.options);
    bytes = ranged::seal(file, "delta", 256);
    ref = protocol::ObjectRef{"deltas/d.safetensors", bytes.size(), sha256_hex(bytes), ""};
    ref.header_sha256 = sha256_hex(std::span<const uint8_t>(bytes).first(ranged::header_prefix_bytes(bytes, bytes.size(), "d")));
  }
  std::span<const uint8_t> prefix() const { return std::span<const uint8_t>(bytes).first(ranged::header_prefix_bytes(bytes, bytes.size(), "d")); }
};

}  // namespace

TEST(SealedHeader, AHeaderMustMatchTheManifestAndEveryChunkItsHash) {
  Sealed s;
  const ranged::SealedHeader h = ranged::read_sealed_header(s.prefix(), s.ref, "d");
  ASSERT_FALSE(h.chunk_ends.empty());
  EXPECT_EQ(h.chunk_ends.back(), h.data_bytes());
  EXPECT_EQ(h.chunk_sha256.size(), h.chunk_ends.size());
  EXPECT_FALSE(h.metadata.count(ranged::kChunkSha256Key));
  EXPECT_FALSE(h.metadata.count(ranged::kChunkSizesKey));
  // Chunks end at every tensor entry and, inside the payload, only at block boundaries: blocks
  // grouped up to the 256-byte target (a larger block alone).
  const st::TensorInfo* cindex = h.find("w.cindex");
  const st::TensorInfo* cdata = h.find("w.cdata");
  ASSERT_TRUE(cindex && cdata);
  const auto& ends = h.chunk_ends;
  EXPECT_TRUE(std::binary_search(ends.begin(), ends.end(), cindex->end));
  EXPECT_TRUE(std::binary_search(ends.begin(), ends.end(), cdata->end));
  const compact::BlockRecords rec = s.e.records();
  std::set<uint64_t> block_starts;
  for (const auto& b : rec.blocks) block_starts.insert(cdata->begin + b.payload_offset);
  for (size_t c = 0; c < ends.size(); ++c) {
    const uint64_t begin = h.chunk_begin(c);
    if (begin < cdata->begin || begin >= cdata->end) continue;
    EXPECT_TRUE(block_starts.count(begin)) << "chunk " << c << " starts inside a block";
    if (ends[c] - begin > 256) EXPECT_EQ(std::next(block_starts.find(begin)) == block_starts.end() ? cdata->end : *std::next(block_starts.find(begin)), ends[c]);
  }
  // The sealed file is still an ordinary compact delta with the same tensors.
  const st::File file = st::File::from_bytes(s.bytes, "d");
  EXPECT_TRUE(compact::is_compact_delta(file));
  EXPECT_EQ(file.tensors().size(), h.tensors.size());

  std::vector<uint8_t> header(s.prefix().begin(), s.prefix().end());
  header[20] ^= 1;
  EXPECT_EQ(error_message([&] { ranged::read_sealed_header(header, s.ref, "d"); }),
            "d: header sha256 differs from the manifest's (corrupt object)");
  std::vector<uint8_t> data(s.bytes.begin() + h.data_offset, s.bytes.end());
  ASSERT_GT(ends.size(), 3u);
  const auto chunk = [&](size_t c) { return std::span<const uint8_t>(data).subspan(h.chunk_begin(c), ends[c] - h.chunk_begin(c)); };
  EXPECT_NO_THROW(ranged::verify_chunks(h, 0, data, "d"));
  EXPECT_NO_THROW(ranged::verify_chunks(h, h.chunk_begin(2), chunk(2), "d"));
  data[h.chunk_begin(2) + 1] ^= 4;
  EXPECT_EQ(error_message([&] { ranged::verify_chunks(h, h.chunk_begin(2), chunk(2), "d"); }),
            "d: data chunk 2 sha256 differs from its header's (corrupt object)");
  EXPECT_NE(error_message([&] { ranged::verify_chunks(h, h.chunk_begin(2) + 1, chunk(2).subspan(1), "d"); }).find("not whole chunks"),
            std::string::npos);
  EXPECT_NE(error_message([&] { ranged::verify_chunks(h, h.chunk_begin(2), chunk(2).first(chunk(2).size() - 1), "d"); })
                .find("not whole chunks"),
            std::string::npos);
}

TEST(SealedHeader, ObjectsSealedWithOneChunkSizeStayReadable) {
  Sealed s(200000);  // larger than the first read
  const std::vector<uint8_t> old = seal_with_one_chunk_size(s.bytes, 256);
  protocol::ObjectRef ref{"deltas/old.safetensors", old.size(), sha256_hex(old), ""};
  const uint64_t prefix = ranged::header_prefix_bytes(old, old.size(), "old");
  ref.header_sha256 = sha256_hex(std::span<const uint8_t>(old).first(prefix));
  const ranged::SealedHeader h = ranged::read_sealed_header(std::span<const uint8_t>(old).first(prefix), ref, "old");
  EXPECT_EQ(h.chunk_ends, fixed_ends(256, h.data_bytes()));
  const std::span<const uint8_t> data = std::span<const uint8_t>(old).subspan(h.data_offset);
  EXPECT_NO_THROW(ranged::verify_chunks(h, 512, data.subspan(512, 256), "old"));
  EXPECT_NE(error_message([&] { ranged::verify_chunks(h, 100, data.subspan(100, 256), "old"); }).find("not whole chunks"), std::string::npos);
  // And fetched by ranges like any other (two ranks below read the new form).
  TempDir dir;
  const std::unique_ptr<Store> store_ptr = open_store(dir.path().string());
  Store& store = *store_ptr;
  store.put(ref.key, old);
  const uint64_t n = s.e.m.meta[0].numel();
  const ranged::RangedDelta half = ranged::fetch_needed(store, ref, {{"w", {s.e.m.meta[0].shape, {{0, n / 2}}}}}, {}, {nullptr, 0});
  EXPECT_LT(half.bytes_fetched, old.size());
}

TEST(SealedHeader, RefusesChunkSizesThatDoNotTileTheData) {
  Sealed s;
  const uint64_t prefix = ranged::header_prefix_bytes(s.bytes, s.bytes.size(), "d");
  const uint64_t data_bytes = s.bytes.size() - prefix;
  auto with_sizes = [&](const std::string& sizes, const std::string& old_size = "") {
    std::vector<uint8_t> bytes = reseal_metadata(s.bytes, [&](nlohmann::ordered_json& md) {
      md[ranged::kChunkSizesKey] = sizes;
      if (!old_size.empty()) md[ranged::kChunkBytesKey] = old_size;
    });
    protocol::ObjectRef ref{"d", bytes.size(), "", ""};
    const uint64_t p = ranged::header_prefix_bytes(bytes, bytes.size(), "d");
    ref.header_sha256 = sha256_hex(std::span<const uint8_t>(bytes).first(p));
    return error_message([&] { ranged::read_sealed_header(std::span<const uint8_t>(bytes).first(p), ref, "d"); });
  };
  EXPECT_NE(with_sizes(std::to_string(data_bytes - 1)).find("range_chunk_sizes does not tile"), std::string::npos);
  EXPECT_NE(with_sizes("0," + std::to_string(data_bytes)).find("does not tile"), std::string::npos);
  EXPECT_NE(with_sizes(std::to_string(data_bytes) + ",1").find("does not tile"), std::string::npos);
  EXPECT_NE(with_sizes("x").find("range_chunk_sizes"), std::string::npos);
  EXPECT_NE(with_sizes(std::to_string(data_bytes), "256").find("not sealed for ranged reads"), std::string::npos);
}

TEST(RangedPlan, AReceiverOfHalfATensorReadsTheIndexAndOnlyTheBlocksThatMeetItsHalf) {
  Sealed s;
  const ranged::SealedHeader h = ranged::read_sealed_header(s.prefix(), s.ref, "d");
  const uint64_t n = s.e.m.meta[0].numel();
  const st::File file = st::File::from_bytes(s.bytes, "d");
  auto cindex = [&](const std::string& t) { return file.bytes(file.at(t + ".cindex")); };
  ranged::NeededRanges first_half{{"w", {s.e.m.meta[0].shape, {{0, n / 2}}}}};
  const ranged::ObjectReadPlan plan = ranged::plan_object_reads(h, first_half, {}, cindex, "d");
  ASSERT_EQ(plan.blocks.size(), 1u);
  const compact::BlockRecords rec = s.e.records();
  for (uint32_t b : plan.blocks[0].chosen) EXPECT_LT(rec.blocks[b].first_position, n / 2);
  EXPECT_EQ(plan.blocks[0].chosen.size(), compact::blocks_overlapping(rec, first_half.at("w").spans).size());
  EXPECT_LT(plan.bytes() - plan.header_bytes, h.data_bytes() * 7 / 10);  // a small file: the header is most of it
  for (const auto& r : plan.block_chunks) {
    EXPECT_TRUE(r.offset == 0 || std::binary_search(h.chunk_ends.begin(), h.chunk_ends.end(), r.offset));
    EXPECT_TRUE(std::binary_search(h.chunk_ends.begin(), h.chunk_ends.end(), r.end()));
  }
  // The same plan for a version whose delta is this object, as a benchmark would count it.
  protocol::Manifest m;
  m.version = 2;
  m.delta = s.ref;
  const auto version_plan = ranged::plan_delta_reads(m, std::span(&h, 1), first_half, [&](size_t, const std::string& t) { return cindex(t); });
  ASSERT_EQ(version_plan.size(), 1u);
  EXPECT_EQ(version_plan[0].bytes(), plan.bytes());
  EXPECT_EQ(version_plan[0].block_chunks, plan.block_chunks);
  // Nothing needed: the header alone.
  const ranged::ObjectReadPlan none = ranged::plan_object_reads(h, {}, {}, cindex, "d");
  EXPECT_EQ(none.bytes(), h.data_offset);
  EXPECT_EQ(none.requests(), 1u);
  // A part whose placement of the tensor misses the needed half: no index read either.
  protocol::PartPlacements halves(2);
  const Placement both[] = {offset_placement(0, n / 2), offset_placement(n / 2, n - n / 2)};
  halves.set("w", protocol::pattern_of(both));
  EXPECT_TRUE(ranged::plan_index_reads(h, first_half, ranged::PartScope{&halves, 1}, "d").tensors.empty());
  EXPECT_EQ(ranged::plan_index_reads(h, first_half, ranged::PartScope{&halves, 0}, "d").tensors, std::vector<std::string>{"w"});
}

// ---- two ranks ------------------------------------------------------------------------------

namespace {

// Two ranks on threads: each holds its half of every [rows, cols] tensor -- its rows (as tensor
// parallelism splits a column-parallel weight, the flat halves) or its columns (a row-parallel
// weight: half of every row) -- owns it for digests, and sums partials with the other.
enum class Split { Rows, Columns };

// The flat runs [start, +length) of tensor `t` that rank `r` of two holds.
std::vector<std::pair<int64_t, int64_t>> held_runs(const TensorMeta& t, int r, Split split) {
  const auto n = static_cast<int64_t>(t.numel());
  if (split == Split::Rows) return {{r == 0 ? 0 : n / 2, r == 0 ? n / 2 : n - n / 2}};
  const auto cols = static_cast<int64_t>(t.shape.back()), rows = n / cols, half = cols / 2;
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t row = 0; row < rows; ++row) runs.emplace_back(row * cols + r * half, r == 0 ? half : cols - half);
  return runs;
}

struct TwoRanks {
  std::vector<TensorMeta> hf;
  Split split;
  std::vector<std::vector<std::vector<uint8_t>>> memory;  // [rank][tensor]
  std::barrier<> sync_point{2};
  std::array<std::vector<uint64_t>, 2> partial;
  engine::CpuSyncEngine engines[2];
  std::vector<std::unique_ptr<MappedReceiver>> receivers;

  explicit TwoRanks(std::vector<TensorMeta> meta, Split how = Split::Rows) : hf(std::move(meta)), split(how), memory(2) {
    for (int r = 0; r < 2; ++r) {
      MappedModel mm;
      mm.hf = hf;
      for (size_t t = 0; t < hf.size(); ++t) {
        MappedRuns runs{static_cast<uint32_t>(t), static_cast<uint32_t>(t), {}, {}, {}};
        OwnedRanges owned{static_cast<uint32_t>(t), {}, {}};
        int64_t len = 0;
        for (const auto& [start, length] : held_runs(hf[t], r, split)) {
          runs.hf_start.push_back(start);
          runs.length.push_back(length);
          runs.rt_start.push_back(len);
          owned.start.push_back(start);
          owned.length.push_back(length);
          len += length;
        }
        memory[r].emplace_back(static_cast<size_t>(len) * hf[t].width(), 0);
        mm.params_meta.push_back(TensorMeta{hf[t].name, hf[t].dtype, {static_cast<uint64_t>(len)}});
        mm.params.push_back(TensorRef{hf[t].name, memory[r][t].data(), static_cast<uint64_t>(len), hf[t].width()});
        mm.runs.push_back(std::move(runs));
        mm.owned.push_back(std::move(owned));
      }
      receivers.push_back(std::make_unique<MappedReceiver>(std::move(mm), engines[r], [this, r](std::span<uint64_t> v) {
        partial[r].assign(v.begin(), v.end());
        sync_point.arrive_and_wait();
        for (size_t i = 0; i < v.size(); ++i) v[i] = partial[0][i] + partial[1][i];
        sync_point.arrive_and_wait();
      }));
    }
  }

  // Both ranks sync (each its own subscriber, reading ranges `gap_bytes` apart as one: 0 by
  // default, so that a test sees the bytes a rank needs); the reports, or the errors' messages.
  std::array<std::variant<SyncReport, std::string>, 2> sync(Store& store, uint64_t gap_bytes = 0) {
    std::array<std::variant<SyncReport, std::string>, 2> out;
    auto run = [&](int r) {
      try {
        SubscriberOptions options;
        options.range_gap_bytes = gap_bytes;
        Subscriber sub(store, options);
        out[r] = sub.sync(*receivers[r]);
      } catch (const std::exception& e) {
        out[r] = std::string(e.what());
      }
    };
    std::thread other(run, 1);
    run(0);
    other.join();
    return out;
  }

  bool holds(const std::vector<std::vector<uint8_t>>& full) const {
    for (int r = 0; r < 2; ++r)
      for (size_t t = 0; t < hf.size(); ++t) {
        const uint64_t w = hf[t].width();
        uint64_t at = 0;
        for (const auto& [start, length] : held_runs(hf[t], r, split)) {
          if (std::memcmp(memory[r][t].data() + at * w, full[t].data() + static_cast<uint64_t>(start) * w, static_cast<uint64_t>(length) * w) != 0)
            return false;
          at += static_cast<uint64_t>(length);
        }
      }
    return true;
  }

  // What rank r needs of every tensor (the planner's input).
  ranged::NeededRanges needed(int r) const {
    ranged::NeededRanges out;
    for (const TensorMeta& t : hf) {
      std::vector<ElementSpan> spans;
      for (const auto& [start, length] : held_runs(t, r, split))
        spans.push_back({static_cast<uint64_t>(start), static_cast<uint64_t>(start + length)});
      out.emplace(t.name, ranged::NeededTensor{t.shape, ranged::merge_spans(std::move(spans))});
    }
    return out;
  }
};

// What the trainers of these tests publish with: deltas only, blocks of 256 changes.
PublisherOptions small_blocks() {
  PublisherOptions o;
  o.anchor_every = 0;
  o.compact_block_elements = 256;
  return o;
}

struct Trainer {
  std::vector<TensorMeta> meta{{"a.weight", DType::BF16, {2048, 256}}, {"b.weight", DType::BF16, {1024, 256}}};
  std::vector<std::vector<uint8_t>> bits;
  Trainer() {
    for (size_t t = 0; t < meta.size(); ++t) bits.push_back(random_bytes(meta[t].numel() * 2, 11 + t));
  }
  void step(uint64_t seed) {  // ~2% of the elements, one ulp
    std::mt19937_64 rng(seed);
    for (auto& b : bits)
      for (size_t i = 0; i < b.size() / 2; ++i)
        if (rng() % 50 == 0) b[2 * i] ^= 1;
  }
  std::vector<ConstTensorRef> refs() const {
    std::vector<ConstTensorRef> out;
    for (size_t t = 0; t < meta.size(); ++t) out.push_back({meta[t].name, bits[t].data(), meta[t].numel(), 2});
    return out;
  }
};

}  // namespace

// In either container layout; a tampered block is refused in the layout's words (layout 1: the
// chunk's hash in the header; the indexed layout: the block's hash in its tensor's entry).
TEST(RangedSync, TwoRanksEachReadLessThanTheDeltaAndEndBitIdentical) {
  for (const uint32_t layout : {compact::kLayout1, compact::kLayout2}) {
    SCOPED_TRACE("compact_layout " + std::to_string(layout));
    TempDir dir;
    auto store = std::shared_ptr<Store>(open_store(dir.path().string()));
    Trainer trainer;
    PublisherOptions o = small_blocks();
    o.compact_layout = layout;
    Publisher pub(store, trainer.meta, o);
    TwoRanks ranks(trainer.meta);
    for (uint64_t v = 1; v <= 3; ++v) {
      if (v > 1) trainer.step(v);
      pub.publish(v, trainer.refs());
      pub.flush();
      auto reports = ranks.sync(*store);
      for (int r = 0; r < 2; ++r) {
        ASSERT_TRUE(std::holds_alternative<SyncReport>(reports[r])) << "rank " << r << ": " << std::get<std::string>(reports[r]);
        const SyncReport& rep = std::get<SyncReport>(reports[r]);
        EXPECT_EQ(rep.to, v);
        if (v > 1) {
          EXPECT_GT(rep.delta_bytes, 0u);
          EXPECT_LT(rep.bytes_fetched, rep.delta_bytes * 8 / 10) << "rank " << r << " at version " << v;
        }
      }
      EXPECT_TRUE(ranks.holds(trainer.bits)) << "version " << v;
    }
    // A tampered block (one payload bit, the whole object's SHA-256 left stale as an attacker on
    // the wire would): both ranks refuse and keep version 3's bits.
    const protocol::Manifest m4 = [&] {
      const auto before = trainer.bits;
      trainer.step(4);
      pub.publish(4, trainer.refs());
      pub.flush();
      protocol::Catalog c(*store);
      const protocol::Manifest m = *c.find(4);
      trainer.bits = before;
      return m;
    }();
    auto object = store->get(m4.delta->key);
    object[object.size() - 3] ^= 0x10;  // inside the last block of the last tensor: rank 1's
    store->put(m4.delta->key, object);
    auto reports = ranks.sync(*store);
    // The rank whose block it is refuses (one line naming the object and the chunk, or the tensor
    // and block); the other rank is refused by it in their agreement; the recovery from anchor 1
    // meets the same block again.
    ASSERT_TRUE(std::holds_alternative<std::string>(reports[1])) << "rank 1 accepted a tampered block";
    const std::string& refusal = std::get<std::string>(reports[1]);
    if (layout == compact::kLayout1) {
      EXPECT_NE(refusal.find(m4.delta->key + ": data chunk "), std::string::npos) << refusal;
      EXPECT_NE(refusal.find(" sha256 differs from its header's (corrupt object)"), std::string::npos) << refusal;
    } else {
      EXPECT_NE(refusal.find(m4.delta->key + ": tensor b.weight: block "), std::string::npos) << refusal;
      EXPECT_NE(refusal.find(" sha256 differs from its entry's (corrupt object)"), std::string::npos) << refusal;
    }
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(std::holds_alternative<std::string>(reports[r])) << "rank " << r << " applied version 4";
      EXPECT_EQ(ranks.receivers[r]->version(), 3u);
    }
    EXPECT_TRUE(ranks.holds(trainer.bits));
  }
}

// Row-parallel weights (each rank holds half of every row): without tiles every block meets
// both ranks. With column bands (the publisher's default tiles) each rank reads only the blocks
// of its own bands, and ends bit-identical -- in either container layout.
TEST(RangedSync, TwoRanksSplittingColumnsReadOnlyTheBlocksOfTheirBands) {
  for (const uint32_t layout : {compact::kLayout1, compact::kLayout2})
  for (const uint32_t max_tiles : {1u, compact::kDefaultMaxTiles}) {
    SCOPED_TRACE("compact_layout " + std::to_string(layout) + ", max_tiles " + std::to_string(max_tiles));
    TempDir dir;
    auto store = std::shared_ptr<Store>(open_store(dir.path().string()));
    Trainer trainer;
    PublisherOptions o = small_blocks();
    o.compact_max_tiles = max_tiles;
    o.compact_layout = layout;
    Publisher pub(store, trainer.meta, o);
    TwoRanks ranks(trainer.meta, Split::Columns);
    pub.publish(1, trainer.refs());
    pub.flush();
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(std::holds_alternative<SyncReport>(ranks.sync(*store)[r]));
    trainer.step(2);
    pub.publish(2, trainer.refs());
    pub.flush();
    const auto reports = ranks.sync(*store);
    EXPECT_TRUE(ranks.holds(trainer.bits));

    // The rank's reads: every block it reads lies in one of its bands.
    protocol::Catalog catalog(*store);
    const protocol::Manifest m = *catalog.find(2);
    const compact::TensorTable table(trainer.meta);
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(std::holds_alternative<SyncReport>(reports[r])) << "rank " << r << ": " << std::get<std::string>(reports[r]);
      const SyncReport& rep = std::get<SyncReport>(reports[r]);
      const ranged::RangedDelta read = ranged::fetch_needed(*store, *m.delta, ranks.needed(r), {}, {&table, 0});
      EXPECT_EQ(read.bytes_fetched, rep.bytes_fetched) << "the subscriber read what the planner says";
      ASSERT_EQ(read.blocks.size(), trainer.meta.size());
      for (const ranged::BlockReads& reads : read.blocks) {
        const compact::TileGeometry& g = reads.records.tiles;
        if (max_tiles == 1) {
          EXPECT_EQ(reads.chosen.size(), reads.records.blocks.size()) << "without tiles a row-parallel rank needs every block";
          continue;
        }
        ASSERT_EQ(g.bands % 2, 0u) << reads.tensor;
        size_t mine = 0;
        for (const auto& b : reads.records.blocks) {
          const uint64_t band = g.tile_of(b.first_position) / g.stripes;
          mine += band / (g.bands / 2) == static_cast<uint64_t>(r);
        }
        EXPECT_EQ(reads.chosen.size(), mine) << reads.tensor;
        for (const uint32_t b : reads.chosen)
          EXPECT_EQ(g.tile_of(reads.records.blocks[b].first_position) / g.stripes / (g.bands / 2), static_cast<uint64_t>(r))
              << reads.tensor << " block " << b;
      }
      if (max_tiles == 1)
        EXPECT_GT(rep.bytes_fetched, rep.delta_bytes * 9 / 10) << "rank " << r;
      else
        EXPECT_LT(rep.bytes_fetched, rep.delta_bytes * 7 / 10) << "rank " << r;  // its bands, the header, the indexes
    }
  }
}

// A store written by two trainer ranks (each the flat half of every tensor, as a delta part):
// each receiver rank reads both parts' headers (their digest partials), but the index and
// blocks of the part that holds its half only.
TEST(RangedSync, TwoRanksFollowingAShardedPublisherReadTheirPartsBlocksOnly) {
  TempDir dir;
  auto store = std::shared_ptr<Store>(open_store(dir.path().string()));
  Trainer trainer;
  PublisherOptions o = small_blocks();
  const ClaimOutcome claim = claim_for_group(*store, o);
  std::vector<std::unique_ptr<ShardPublisher>> trainers;
  auto half = [&](size_t t, uint64_t r) {
    const uint64_t n = trainer.meta[t].numel();
    return offset_placement(r * (n / 2), r == 0 ? n / 2 : n - n / 2);
  };
  for (uint64_t r = 0; r < 2; ++r) {
    std::vector<ShardTensor> tensors;
    for (size_t t = 0; t < trainer.meta.size(); ++t) tensors.push_back(ShardTensor{trainer.meta[t], half(t, r)});
    trainers.push_back(std::make_unique<ShardPublisher>(store, tensors, r, claim, std::make_unique<engine::CpuSyncEngine>(), o));
  }
  TwoRanks ranks(trainer.meta);
  for (uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) trainer.step(v);
    std::vector<PartReceipt> receipts;
    const bool anchor = trainers[0]->anchor_due(v);
    for (uint64_t r = 0; r < 2; ++r) {
      std::vector<ConstTensorRef> local;
      for (size_t t = 0; t < trainer.meta.size(); ++t) {
        const Placement p = half(t, r);
        local.push_back({trainer.meta[t].name, trainer.bits[t].data() + p.first * 2, p.numel(), 2});
      }
      receipts.push_back(trainers[r]->publish_part(v, local, anchor));
    }
    std::vector<uint64_t> digests(trainer.meta.size(), 0);  // what the reduce sums
    for (const auto& r : receipts)
      for (size_t t = 0; t < digests.size(); ++t) digests[t] += r.partials[t];
    const CommitOutcome outcome = commit_parts(*store, GatheredReceipts{receipts, digests, trainers[0]->tensors()},
                                               trainers[0]->state().last_anchor_version, trainers[0]->fence());
    ASSERT_TRUE(outcome.committed) << outcome.error;
    for (auto& t : trainers) t->conclude(outcome);
    auto reports = ranks.sync(*store);
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(std::holds_alternative<SyncReport>(reports[r])) << "rank " << r << ": " << std::get<std::string>(reports[r]);
      const SyncReport& rep = std::get<SyncReport>(reports[r]);
      if (v > 1) EXPECT_LT(rep.bytes_fetched, rep.delta_bytes * 7 / 10) << "rank " << r << " at version " << v;
    }
    EXPECT_TRUE(ranks.holds(trainer.bits)) << "version " << v;
  }
}

// ---- the indexed layout by ranges --------------------------------------------------------------

namespace {

namespace ix = compact::indexed;

// 640 tensors "t.0" .. "t.639" of [4, 2048] bf16 elements (natural order: ordinal = the number),
// every one changed at 5% in blocks of 256, with digests: one indexed delta in memory, read
// through a counting ranged GET.
struct Indexed {
  Model m;
  std::vector<uint8_t> bytes;
  protocol::ObjectRef ref;
  std::unique_ptr<compact::TensorTable> table;
  uint64_t gets = 0;
  Indexed() {
    std::mt19937_64 rng(9);
    for (int t = 0; t < 640; ++t) {
      m.add_shaped("t." + std::to_string(t), DType::BF16, {4, 2048});
      fill_base(m.base[t], 2, rng, false);
      make_changes(m, t, 0.05, Change::Ulp, rng);
    }
    m.encode();
    table = std::make_unique<compact::TensorTable>(m.meta);
    DeltaInfo info;
    std::vector<uint64_t> base(m.meta.size());
    for (size_t t = 0; t < base.size(); ++t) base[t] = rng();
    integrity::put_delta_digests(info, integrity::delta_digests(m.meta, m.delta.view(), base, 2, 1));
    compact::Options options;
    options.block_elements = 256;
    options.max_tiles = 1;
    options.layout = compact::kLayout2;
    bytes = compact::serialize_compact_delta(m.meta, m.delta.view(), info, options);
    ref = protocol::ObjectRef{"deltas/x", bytes.size(), sha256_hex(bytes), ""};
    ref.header_sha256 = sha256_hex(std::span<const uint8_t>(bytes).first(ranged::header_prefix_bytes(bytes, bytes.size(), "x")));
  }
  ranged::NeededRanges needed(std::initializer_list<std::pair<int, int>> runs) const {
    ranged::NeededRanges out;
    for (const auto& [first, last] : runs)
      for (int t = first; t <= last; ++t) out.emplace(m.meta[t].name, ranged::NeededTensor{m.meta[t].shape, {{0, m.meta[t].numel()}}});
    return out;
  }
  ranged::RangedDelta read(const ranged::NeededRanges& need, uint64_t gap, const std::vector<uint8_t>* object = nullptr) {
    const std::vector<uint8_t>& o = object ? *object : bytes;
    const ranged::RangeGet get = [&](uint64_t offset, uint64_t length) {
      ++gets;
      return std::vector<uint8_t>(o.begin() + static_cast<std::ptrdiff_t>(offset), o.begin() + static_cast<std::ptrdiff_t>(offset + length));
    };
    return ranged::read_needed(get, ref, need, {}, {table.get(), gap}, "x");
  }
  // Where things are in the object (what the test plans by hand).
  struct Place {
    uint64_t data = 0;
    ix::Layout layout;
    std::vector<ix::Record> records;
  };
  Place place() const {
    const st::File file = st::File::from_bytes(bytes, "x");
    Place p;
    p.data = ranged::header_prefix_bytes(bytes, bytes.size(), "x");
    p.layout = ix::read_layout(file.tensors(), file.metadata(), bytes.size() - p.data, "x");
    for (uint64_t k = 0; k < p.layout.record_count(); ++k)
      p.records.push_back(ix::read_record(bytes.data() + p.data + p.layout.records.begin + k * ix::kRecordBytes));
    return p;
  }
  // Tensor k's payload size (from its block index entry's header).
  uint64_t payload_bytes(const Place& p, size_t k) const {
    return detail::load_le<uint64_t>(bytes.data() + p.data + p.layout.index.begin + p.records[k].index_offset + 8);
  }
};

}  // namespace

TEST(IndexedRanged, AReceiverReadsTheHeadAPageItsEntriesAndItsBlocksOnly) {
  Indexed x;
  const Indexed::Place p = x.place();
  ASSERT_EQ(p.records.size(), 640u);
  // t.200 .. t.209: records of page 3 (192 .. 255), their entries and payloads, each contiguous.
  const ranged::RangedDelta read = x.read(x.needed({{200, 209}}), 0);
  uint64_t entries = 0, payloads = 0;
  for (size_t k = 200; k <= 209; ++k) {
    entries += p.records[k].index_bytes;
    payloads += x.payload_bytes(p, k);
  }
  // The header's length, the header, the bitmap and page hashes, the page, the entries, the blocks.
  const uint64_t head = p.data + p.layout.pages.end;
  EXPECT_EQ(read.requests, 6u);
  EXPECT_EQ(x.gets, 6u);
  EXPECT_EQ(read.head_bytes, head);
  EXPECT_EQ(read.index_bytes, 64 * ix::kRecordBytes + entries);
  EXPECT_EQ(read.block_bytes, payloads);
  EXPECT_EQ(read.bytes_fetched, head + 64 * ix::kRecordBytes + entries + payloads);
  EXPECT_LT(read.bytes_fetched, x.bytes.size() / 20);
  // The reduced file: the ten records, their changes exactly, their digests.
  const st::File reduced = st::File::from_bytes(read.file, "reduced");
  EXPECT_EQ(reduced.at(ix::kRecords).nbytes(), 10 * ix::kRecordBytes);
  compact::DecodedDelta decoded;
  compact::decode_compact_delta(reduced, x.m.meta, x.m.base_refs(), decoded);
  for (size_t t = 0; t < 640; ++t) {
    const bool needed = t >= 200 && t <= 209;
    EXPECT_EQ(decoded.storage.offsets[t + 1] - decoded.storage.offsets[t], needed ? x.m.delta.offsets[t + 1] - x.m.delta.offsets[t] : 0u) << t;
  }
  const auto promises = integrity::read_delta_digests(decoded.info, "reduced");
  ASSERT_TRUE(promises);
  EXPECT_EQ(promises->base.size(), 10u);
  EXPECT_TRUE(promises->base.contains("t.205"));
  // Half of a tensor: its records and entry as before, the blocks of its first half only.
  ranged::NeededRanges half;
  half.emplace("t.300", ranged::NeededTensor{x.m.meta[300].shape, {{0, 4096}}});
  const ranged::RangedDelta h = x.read(half, 0);
  ASSERT_EQ(h.blocks.size(), 1u);
  EXPECT_LT(h.blocks[0].chosen.size(), h.blocks[0].records.blocks.size());
  for (const uint32_t b : h.blocks[0].chosen) EXPECT_LT(h.blocks[0].records.blocks[b].first_position, 4096u);
}

TEST(IndexedRanged, RangesAtMostAGapApartAreReadAsOneRequest) {
  using Ranges = std::vector<ByteRange>;
  // Sorted; overlapping and touching ranges always join, empty ones vanish.
  EXPECT_EQ(ranged::merge_gaps({{100, 10}, {0, 10}, {20, 5}}, 0), (Ranges{{0, 10}, {20, 5}, {100, 10}}));
  EXPECT_EQ(ranged::merge_gaps({{0, 10}, {5, 2}, {10, 0}, {10, 4}}, 0), (Ranges{{0, 14}}));
  // A gap joins when it is at most gap_bytes and the read's gap bytes stay within 1/8 of its
  // ranges' bytes: 10 * 8 <= 100 + 60 joins; then 130 > gap_bytes 100; with 200, (10 + 130) * 8 >
  // 160 + 50 still keeps [300, +50) apart; 50 * 8 > 50 + 10 keeps [400, +10) apart.
  const Ranges four{{0, 100}, {110, 60}, {300, 50}, {400, 10}};
  EXPECT_EQ(ranged::merge_gaps(four, 9), four);
  EXPECT_EQ(ranged::merge_gaps(four, 10), (Ranges{{0, 170}, {300, 50}, {400, 10}}));
  EXPECT_EQ(ranged::merge_gaps(four, 200), (Ranges{{0, 170}, {300, 50}, {400, 10}}));
  // The cap counts every gap a read went through: 100 * 8 <= 800 + 10 joins, (100 + 90) * 8 > 810 + 10 does not.
  EXPECT_EQ(ranged::merge_gaps({{0, 800}, {900, 10}, {1000, 10}}, 1000), (Ranges{{0, 910}, {1000, 10}}));
  // Small ranges far apart (another rank's tiles between) stay apart whatever the gap; without
  // the cap (metadata reads) the request cost alone decides.
  EXPECT_EQ(ranged::merge_gaps({{0, 1000}, {5000, 1000}}, 1 << 20), (Ranges{{0, 1000}, {5000, 1000}}));
  EXPECT_EQ(ranged::merge_gaps({{0, 1000}, {5000, 1000}}, 4000, ranged::GapCap::kNone), (Ranges{{0, 6000}}));
  EXPECT_EQ(ranged::merge_gaps({{0, 1000}, {5000, 1000}}, 3999, ranged::GapCap::kNone), (Ranges{{0, 1000}, {5000, 1000}}));

  // t.200..t.209 and t.211..t.215: t.210 makes one gap among the entries (E bytes: joined by the
  // request cost alone) and one among the payloads (P bytes, P > E: joined while within 1/8 of
  // what the read around it asks for).
  Indexed x;
  const Indexed::Place p = x.place();
  uint64_t E = 0, P = 0, base = p.data + p.layout.pages.end + 64 * ix::kRecordBytes, payloads_before = 0;
  for (size_t k = 200; k <= 215; ++k) {
    const bool between = k == 210;
    (between ? E : base) += p.records[k].index_bytes;
    (between ? P : base) += x.payload_bytes(p, k);
    if (k < 210) payloads_before += x.payload_bytes(p, k);
  }
  ASSERT_LT(E, P);
  ASSERT_LE(P * ranged::kGapShare, payloads_before + x.payload_bytes(p, 211));
  const ranged::NeededRanges need = x.needed({{200, 209}, {211, 215}});
  const ranged::RangedDelta apart = x.read(need, 0), entries_joined = x.read(need, E), all_joined = x.read(need, P);
  // The header (two reads), the bitmap and page hashes, the page, the entries and the blocks, the
  // last two in two requests each unless joined.
  EXPECT_EQ(apart.requests, 8u);
  EXPECT_EQ(apart.bytes_fetched, base);
  EXPECT_EQ(entries_joined.requests, 7u);
  EXPECT_EQ(entries_joined.bytes_fetched, base + E);
  EXPECT_EQ(all_joined.requests, 6u);
  EXPECT_EQ(all_joined.bytes_fetched, base + E + P);
  // The same reduced file whatever was read through.
  EXPECT_EQ(apart.file, all_joined.file);
}

TEST(IndexedRanged, EveryTamperedPieceIsRefusedInOneLineBeforeUse) {
  Indexed x;
  const Indexed::Place p = x.place();
  const ranged::NeededRanges need = x.needed({{200, 209}});
  auto refused = [&](uint64_t offset) {
    std::vector<uint8_t> bad = x.bytes;
    bad[offset] ^= 0x04;
    return error_message([&] { x.read(need, 0, &bad); });
  };
  const uint64_t d = p.data;
  EXPECT_EQ(refused(20), "x: header sha256 differs from the manifest's (corrupt object)");
  EXPECT_EQ(refused(d + p.layout.present.begin + 10), "x: presence bitmap sha256 differs from its header's (corrupt object)");
  EXPECT_EQ(refused(d + p.layout.pages.begin + 3 * ix::kHashBytes), "x: record page hashes' sha256 differs from its header's (corrupt object)");
  EXPECT_EQ(refused(d + p.layout.records.begin + 205 * ix::kRecordBytes + 24), "x: record page 3 sha256 differs from its hash (corrupt object)");
  EXPECT_EQ(refused(d + p.layout.index.begin + p.records[205].index_offset + 40),
            "x: tensor t.205: block index entry sha256 differs from its record's (corrupt object)");
  EXPECT_EQ(refused(d + p.layout.payload.begin + p.records[205].payload_offset + 1), "x: tensor t.205: block 0 sha256 differs from its entry's (corrupt object)");
  // Bytes nobody needs are not read, so not checked: another tensor's block goes unnoticed here.
  EXPECT_NO_THROW(x.read(need, 0, nullptr));
  std::vector<uint8_t> other = x.bytes;
  other[d + p.layout.payload.begin + p.records[400].payload_offset] ^= 1;
  EXPECT_NO_THROW(x.read(need, 0, &other));
  // And another model's table is refused before any record is read.
  std::vector<TensorMeta> renamed = x.m.meta;
  renamed[7].name = "u.7";
  const compact::TensorTable other_table(renamed);
  const ranged::RangeGet get = [&](uint64_t offset, uint64_t length) {
    return std::vector<uint8_t>(x.bytes.begin() + static_cast<std::ptrdiff_t>(offset), x.bytes.begin() + static_cast<std::ptrdiff_t>(offset + length));
  };
  EXPECT_NE(error_message([&] { ranged::read_needed(get, x.ref, need, {}, {&other_table, 0}, "x"); }).find("x: written for another tensor table"),
            std::string::npos);
}

// A tampered record on the way to two ranks: both refuse in one line and keep their weights.
TEST(RangedSync, TwoRanksRefuseATamperedRecordAndKeepTheirWeights) {
  TempDir dir;
  auto store = std::shared_ptr<Store>(open_store(dir.path().string()));
  Trainer trainer;
  Publisher pub(store, trainer.meta, small_blocks());
  TwoRanks ranks(trainer.meta);
  pub.publish(1, trainer.refs());
  pub.flush();
  for (const auto& r : ranks.sync(*store)) ASSERT_TRUE(std::holds_alternative<SyncReport>(r));
  const auto before = trainer.bits;
  trainer.step(2);
  pub.publish(2, trainer.refs());
  pub.flush();
  protocol::Catalog catalog(*store);
  const protocol::Manifest m = *catalog.find(2);
  std::vector<uint8_t> object = store->get(m.delta->key);
  const st::File file = st::File::from_bytes(object, "d");
  const uint64_t data = ranged::header_prefix_bytes(object, object.size(), "d");
  object[data + file.at(ix::kRecords).begin + ix::kRecordBytes + 30] ^= 1;  // b.weight's result digest
  store->put(m.delta->key, object);
  const auto reports = ranks.sync(*store);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(std::holds_alternative<std::string>(reports[r])) << "rank " << r << " applied version 2";
    const std::string& e = std::get<std::string>(reports[r]);
    EXPECT_NE(e.find(m.delta->key + ": record page 0 sha256 differs from its hash (corrupt object)"), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos);
    EXPECT_EQ(ranks.receivers[r]->version(), 1u);
  }
  EXPECT_TRUE(ranks.holds(before));
}
