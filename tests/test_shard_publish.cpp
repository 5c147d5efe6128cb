// Shard-local publish: placements (torch.chunk cuts on any dimension), digests of shards in full
// positions, the receipts' checks at commit, and readers combining a version's parts -- a model
// published by 4 ranks reads exactly like one published by 1.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include <nlohmann/json.hpp>

#include "codec/compact_indexed.hpp"
#include "codec/delta_io.hpp"
#include "codec/digest.hpp"
#include "core/placement.hpp"
#include "engine/cpu_sync_engine.hpp"
#include "format/sha256.hpp"
#include "store/store.hpp"
#include "sync/mapped_receiver.hpp"
#include "sync/range_hashes.hpp"
#include "sync/shard_parts.hpp"
#include "sync/publisher.hpp"
#include "sync/shard_publish.hpp"
#include "sync/shard_resume.hpp"
#include "sync/subscriber.hpp"
#include "test_support.hpp"

namespace {

using namespace deltasync;

// Rows of torch.chunk(size, parts)[index], brute force.
std::vector<uint64_t> chunk_rows(uint64_t size, uint64_t parts, uint64_t index) {
  const uint64_t chunk = (size + parts - 1) / parts;
  std::vector<uint64_t> rows;
  for (uint64_t r = chunk * index; r < std::min(size, chunk * (index + 1)); ++r) rows.push_back(r);
  return rows;
}

// Full flat positions of a Shard(dim) part in local row-major order, brute force.
std::vector<uint64_t> shard_positions(const std::vector<uint64_t>& shape, size_t dim, uint64_t parts, uint64_t index) {
  std::vector<uint64_t> out;
  const auto rows = chunk_rows(shape[dim], parts, index);
  uint64_t numel = 1;
  for (uint64_t d : shape) numel *= d;
  std::vector<uint64_t> coord(shape.size(), 0);
  for (uint64_t p = 0; p < numel; ++p) {
    uint64_t rest = p;
    for (size_t d = shape.size(); d-- > 0;) {
      coord[d] = rest % shape[d];
      rest /= shape[d];
    }
    if (std::find(rows.begin(), rows.end(), coord[dim]) != rows.end()) out.push_back(p);
  }
  return out;  // row-major order of the full tensor == row-major order of the local shard
}

TEST(Placement, ShardOnEveryDimensionMatchesTorchChunk) {
  const std::vector<std::vector<uint64_t>> shapes{{10, 3}, {2, 3}, {4, 6}, {3, 5, 7}, {1, 9}, {5}};
  for (const auto& shape : shapes) {
    for (size_t dim = 0; dim < shape.size(); ++dim) {
      for (uint64_t parts : {1u, 2u, 3u, 4u, 8u}) {
        uint64_t numel = 1;
        for (uint64_t d : shape) numel *= d;
        std::vector<Placement> all;
        std::vector<std::string> names;
        for (uint64_t i = 0; i < parts; ++i) {
          const Placement p = shard_placement(shape, dim, i, parts);
          const auto want = shard_positions(shape, dim, parts, i);
          ASSERT_EQ(p.numel(), want.size()) << shape_text(shape) << " dim " << dim << " part " << i << "/" << parts;
          for (uint64_t k = 0; k < want.size(); ++k) {
            ASSERT_EQ(p.full_position(k), want[k]);
            ASSERT_TRUE(p.contains(want[k]));
          }
          all.push_back(p);
          names.push_back("rank " + std::to_string(i));
        }
        EXPECT_NO_THROW(check_tiling(all, names, numel, "w", "test"));
      }
    }
  }
  // torch.chunk leaves trailing parts empty: 2 rows over 4 ranks.
  EXPECT_TRUE(shard_placement(std::vector<uint64_t>{2, 3}, 0, 3, 4).empty());
  EXPECT_THROW(shard_placement(std::vector<uint64_t>{2, 3}, 2, 0, 4), Error);
}

TEST(Placement, TilingRefusesOverlapAndGap) {
  const std::vector<std::string> names{"rank 0", "rank 1"};
  std::vector<Placement> overlap{offset_placement(0, 6), offset_placement(5, 5)};
  EXPECT_EQ(error_message([&] { check_tiling(overlap, names, 10, "layer.w", "version 3"); }),
            "version 3: tensor layer.w: rank 0 and rank 1 overlap at position 5");
  std::vector<Placement> gap{offset_placement(0, 4), offset_placement(6, 4)};
  EXPECT_EQ(error_message([&] { check_tiling(gap, names, 10, "layer.w", "version 3"); }),
            "version 3: tensor layer.w: no part covers positions 4..5");
  std::vector<Placement> short_tail{offset_placement(0, 4), offset_placement(4, 4)};
  EXPECT_EQ(error_message([&] { check_tiling(short_tail, names, 10, "layer.w", "version 3"); }),
            "version 3: tensor layer.w: no part covers positions 8..9");
  std::vector<int64_t> local{0, 2, 3};
  to_full_positions(local, Placement{1, 2, 6, 2}, "w");
  EXPECT_EQ(local, (std::vector<int64_t>{1, 7, 8}));
}

TEST(Placement, ShardDigestsAddUpToTheFullDigest) {
  const std::vector<uint64_t> shape{37, 29};
  const auto bits = random_bytes(37 * 29 * 2, 11);
  const ConstTensorRef whole{"w", bits.data(), 37 * 29, 2};
  const uint64_t full = digest_tensors(std::span(&whole, 1))[0];
  for (size_t dim : {0u, 1u}) {
    uint64_t sum = 0;
    for (uint64_t i = 0; i < 3; ++i) {
      const Placement p = shard_placement(shape, dim, i, 3);
      std::vector<uint8_t> local(p.numel() * 2);
      for (uint64_t k = 0; k < p.numel(); ++k) std::memcpy(&local[k * 2], &bits[p.full_position(k) * 2], 2);
      const ConstTensorRef ref{"w", local.data(), p.numel(), 2};
      sum += digest_placed_tensors(std::span(&ref, 1), std::span(&p, 1))[0];
    }
    EXPECT_EQ(sum, full) << "Shard(" << dim << ")";
  }
}

// ---- a sharded trainer in one process -------------------------------------------------------

struct Layout {
  std::vector<uint64_t> shape;
  DType dtype;
  int dim;  // >= 0: Shard(dim); -1: Replicate()
};

struct World {
  std::vector<TensorMeta> meta;
  std::vector<Layout> layout;
  std::vector<std::vector<uint8_t>> full;  // the trainer's weights as a whole (the test's view)
  std::vector<std::unique_ptr<ShardPublisher>> ranks;
  std::shared_ptr<Store> store;

  Placement placement(size_t t, uint64_t rank) const { return rule_placement(rule(t, rank), meta[t].shape, rank); }
  // What a DTensor says: Shard(dim) over the group's mesh, or Replicate(), at the rank's coordinate.
  PlacementRule rule(size_t t, uint64_t rank) const {
    if (layout[t].dim < 0) return PlacementRule{PlacementRule::Kind::kReplicate, 0, 0, rank};
    return PlacementRule{PlacementRule::Kind::kShard, static_cast<uint32_t>(layout[t].dim), ranks.size(), rank};
  }
  // The last commit: did rank 0 need every rank's table (a second gather), and the receipts' sizes.
  bool gathered_tables = false;
  std::vector<size_t> receipt_bytes;

  World(std::shared_ptr<Store> s, std::vector<Layout> l, uint64_t world, std::string format, std::string run_id = "",
        bool take_over = false, uint32_t compact_layout = compact::kPublisherDefaultLayout)
      : layout(std::move(l)), store(std::move(s)) {
    for (size_t t = 0; t < layout.size(); ++t) {
      meta.push_back(TensorMeta{"layers." + std::to_string(t) + ".weight", layout[t].dtype, layout[t].shape});
      full.push_back(random_bytes(meta[t].numel() * meta[t].width(), 100 + t));
    }
    PublisherOptions o;
    o.delta_format = format;
    o.anchor_every = 4;
    o.anchor_share = 0;  // anchors by count only: versions 1 and 5
    o.run_id = run_id;
    o.take_over = take_over;
    o.compact_layout = compact_layout;
    // Rank 0 claims once; every rank gets the outcome through its wire form, as the broadcast carries it.
    const ClaimOutcome claim = claim_from_json(claim_to_json(claim_for_group(*store, o)), "claim");
    ranks.resize(world);
    for (uint64_t r = 0; r < world; ++r) {
      std::vector<ShardTensor> tensors;
      for (size_t t = 0; t < meta.size(); ++t) tensors.push_back(ShardTensor{meta[t], placement(t, r), rule(t, r)});
      ranks[r] = std::make_unique<ShardPublisher>(store, tensors, r, claim, std::make_unique<engine::CpuSyncEngine>(), o);
    }
  }

  // Rank r's local copy of every tensor (what to_local() gives a trainer).
  std::vector<std::vector<uint8_t>> local(uint64_t r) const {
    std::vector<std::vector<uint8_t>> out;
    for (size_t t = 0; t < meta.size(); ++t) {
      const Placement p = placement(t, r);
      const uint32_t w = meta[t].width();
      std::vector<uint8_t> bytes(p.numel() * w);
      for (uint64_t k = 0; k < p.numel(); ++k) std::memcpy(&bytes[k * w], &full[t][p.full_position(k) * w], w);
      out.push_back(std::move(bytes));
    }
    return out;
  }

  // A sparse "optimizer step": about 1 in 7 elements gets new bits.
  void step(uint64_t seed) {
    for (size_t t = 0; t < meta.size(); ++t) {
      const auto noise = random_bytes(full[t].size(), seed * 31 + t);
      const uint32_t w = meta[t].width();
      for (uint64_t i = 0; i < meta[t].numel(); ++i)
        if (noise[i * w] % 7 == 0) std::memcpy(&full[t][i * w], &noise[i * w], w);
    }
  }

  std::vector<PartReceipt> publish_parts(uint64_t version) {
    std::vector<PartReceipt> receipts;
    const bool anchor = ranks[0]->anchor_due(version);
    for (uint64_t r = 0; r < ranks.size(); ++r) {
      EXPECT_EQ(ranks[r]->anchor_due(version), anchor);
      const auto bytes = local(r);
      std::vector<ConstTensorRef> refs;
      for (size_t t = 0; t < meta.size(); ++t) refs.push_back(ConstTensorRef{meta[t].name, bytes[t].data(), bytes[t].size() / meta[t].width(), meta[t].width()});
      receipts.push_back(ranks[r]->publish_part(version, refs, anchor));
    }
    return receipts;
  }

  // Rank 0's commit of `receipts` as the collectives carry them: receipts through their wire form,
  // partials summed as int64 halves, and -- when the first answer says so -- every rank's table
  // (`tables`: those tables instead of the ranks' own).
  CommitOutcome commit(const std::vector<PartReceipt>& receipts, std::optional<uint64_t> latest_anchor,
                       std::vector<std::vector<ShardTensor>> tables = {}) {
    std::vector<PartReceipt> gathered;
    std::vector<int64_t> sums(2 * meta.size(), 0);
    receipt_bytes.clear();
    for (const auto& r : receipts) {
      const std::vector<uint8_t> bytes = receipt_to_bytes(r);
      receipt_bytes.push_back(bytes.size());
      gathered.push_back(receipt_from_bytes(bytes, "receipt"));
      const std::vector<int64_t> halves = split_partials(r.partials);
      for (size_t i = 0; i < halves.size(); ++i) sums[i] += halves[i];
    }
    const std::vector<uint64_t> digests = join_partials(sums, meta.size(), "sums");
    CommitOutcome out = commit_parts(*store, GatheredReceipts{gathered, digests, ranks[0]->tensors()}, latest_anchor, ranks[0]->fence());
    gathered_tables = out.needs_tables;
    if (!out.needs_tables) return out;
    if (tables.empty())
      for (auto& r : ranks) tables.push_back(r->tensors());
    std::vector<std::vector<ShardTensor>> wire;
    for (const auto& t : tables) wire.push_back(table_from_bytes(table_to_bytes(t), "table"));
    return commit_parts(*store, GatheredReceipts{gathered, digests, ranks[0]->tensors(), wire}, latest_anchor, ranks[0]->fence());
  }

  CommitOutcome publish(uint64_t version) {
    const CommitOutcome outcome = commit(publish_parts(version), ranks[0]->state().last_anchor_version);
    const CommitOutcome heard = outcome_from_json(outcome_to_json(outcome), "outcome");
    for (auto& r : ranks) r->conclude(heard);
    return outcome;
  }
};

void expect_same_bits(const HostModel& model, const World& w) {
  ASSERT_EQ(model.tensors.size(), w.meta.size());
  for (size_t t = 0; t < w.meta.size(); ++t) {
    EXPECT_EQ(model.tensors[t].name, w.meta[t].name);
    EXPECT_EQ(model.tensors[t].shape, w.meta[t].shape);
    EXPECT_TRUE(model.data[t] == w.full[t]) << w.meta[t].name;
  }
}

std::vector<Layout> mixed_layout() {
  return {{{10, 6}, DType::BF16, 0},   // FSDP2's Shard(0), uneven over 4 ranks
          {{2, 5}, DType::BF16, 0},    // 2 rows over 4 ranks: two empty shards
          {{6, 9}, DType::F32, 1},     // Shard(1)
          {{3, 4, 5}, DType::F16, 2},  // Shard on the last dimension
          {{7}, DType::BF16, -1}};     // Replicate(): rank 0 publishes it
}

class ShardPublish : public ::testing::TestWithParam<std::tuple<uint64_t, std::string>> {};

TEST_P(ShardPublish, ReadersStayBitIdenticalAtEveryVersion) {
  const auto [world_size, format] = GetParam();
  TempDir dir;
  World w(open_store(dir.path().string()), mixed_layout(), world_size, format);
  auto reader_store = open_store(dir.path().string());
  Subscriber sub(*reader_store);
  HostModel follower;
  for (uint64_t v = 1; v <= 7; ++v) {
    if (v > 1) w.step(v);
    const CommitOutcome out = w.publish(v);
    ASSERT_TRUE(out.committed) << out.error;
    // Rules everywhere: rank 0 derives every placement, no table crosses between the ranks.
    EXPECT_FALSE(w.gathered_tables);
    for (size_t bytes : w.receipt_bytes) EXPECT_LT(bytes, 600u);
    protocol::Catalog catalog(*reader_store);
    const protocol::Manifest* m = catalog.find(v);
    ASSERT_NE(m, nullptr);
    if (v > 1) {
      // One part is the single form; several are listed with their placements.
      EXPECT_EQ(m->delta.has_value(), world_size == 1);
      EXPECT_EQ(m->delta_parts.size(), world_size == 1 ? 0u : world_size);
    }
    EXPECT_EQ(out.anchor, v == 1 || v == 5);
    auto report = sub.sync(follower);
    EXPECT_EQ(report.to, v);
    if (v > 1 && v != 5) EXPECT_FALSE(report.plan.anchor_version) << "version " << v << " should be reached by its delta";
    expect_same_bits(follower, w);
    // The manifest's digests are the sums of every rank's partials: a fresh full digest agrees.
    HostModel copy = follower;
    copy.compute_digests();
    for (size_t t = 0; t < w.meta.size(); ++t) EXPECT_EQ(m->digests.at(w.meta[t].name), digest_to_hex(copy.digests[t]));
  }
  // What a receiver learns of the model from the anchor's headers alone: the full tensors.
  std::vector<TensorMeta> published = sub.published_tensors(std::nullopt);
  std::sort(published.begin(), published.end(), [](const TensorMeta& a, const TensorMeta& b) { return a.name < b.name; });
  ASSERT_EQ(published.size(), w.meta.size());
  for (size_t t = 0; t < w.meta.size(); ++t) {
    EXPECT_EQ(published[t].name, w.meta[t].name);
    EXPECT_EQ(published[t].shape, w.meta[t].shape);
  }
  // A late reader starts from the newest anchor's slices and the deltas after it.
  HostModel late;
  Subscriber late_sub(*reader_store);
  late_sub.sync(late);
  expect_same_bits(late, w);
}

INSTANTIATE_TEST_SUITE_P(RanksAndLayouts, ShardPublish,
                         ::testing::Combine(::testing::Values(1u, 2u, 4u), ::testing::Values("compact", "trl")));

TEST(ShardCommit, AFailedRankCommitsNothingAndTheNextVersionIsAnAnchor) {
  TempDir dir;
  World w(open_store(dir.path().string()), mixed_layout(), 4, "compact");
  ASSERT_TRUE(w.publish(1).committed);
  w.step(2);
  auto receipts = w.publish_parts(2);
  receipts[2] = failed_receipt(2, 2, "injected failure", false, w.meta.size());
  const CommitOutcome out = w.commit(receipts, 1);
  EXPECT_FALSE(out.committed);
  EXPECT_EQ(out.error, "version 2: rank 2 failed: injected failure");
  for (auto& r : w.ranks) r->conclude(out);
  EXPECT_FALSE(w.store->head(protocol::manifest_key(2)));
  EXPECT_EQ(protocol::read_latest(*w.store), 1u);
  EXPECT_EQ(protocol::read_latest_pointer(*w.store)->fence, w.ranks[0]->fence());
  // Every rank decides alike: the next version restarts from an anchor.
  for (auto& r : w.ranks) EXPECT_TRUE(r->anchor_due(3));
  w.step(3);
  ASSERT_TRUE(w.publish(3).committed);
  HostModel follower;
  Subscriber sub(*w.store);
  EXPECT_EQ(sub.sync(follower).to, 3u);
  expect_same_bits(follower, w);
  w.step(4);
  ASSERT_TRUE(w.publish(4).committed);
  EXPECT_FALSE(sub.sync(follower).plan.anchor_version);
  expect_same_bits(follower, w);
}

TEST(ShardCommit, RefusesDisagreeingRanksOverlapsGapsAndMissingParts) {
  TempDir dir;
  World w(open_store(dir.path().string()), mixed_layout(), 2, "compact");
  ASSERT_TRUE(w.publish(1).committed);
  w.step(2);
  const auto good = w.publish_parts(2);
  auto refused = [&](std::vector<PartReceipt> receipts, std::vector<std::vector<ShardTensor>> tables = {}) {
    const CommitOutcome out = w.commit(receipts, 1, std::move(tables));
    EXPECT_FALSE(out.committed);
    EXPECT_FALSE(w.store->head(protocol::manifest_key(2)));
    EXPECT_EQ(out.error.find('\n'), std::string::npos) << out.error;
    return out.error;
  };
  // A rank whose table differs from rank 0's: its receipt's hash says so, rank 0 gathers every
  // table in a second round and names the rank and the tensor.
  auto with_table = [&](size_t rank, const std::function<void(std::vector<ShardTensor>&)>& edit) {
    std::vector<std::vector<ShardTensor>> tables;
    for (auto& r : w.ranks) tables.push_back(r->tensors());
    edit(tables[rank]);
    auto receipts = good;
    describe_table(tables[rank], receipts[rank]);  // what that rank's publisher would report
    const std::string error = refused(receipts, tables);
    EXPECT_TRUE(w.gathered_tables);
    return error;
  };
  EXPECT_EQ(with_table(1, [](auto& t) { t[0].full.shape = {11, 6}; }),
            "version 2: rank 1 reports tensor layers.0.weight as BF16[11, 6], rank 0 as BF16[10, 6]");
  EXPECT_EQ(with_table(1, [](auto& t) { t[2].full.dtype = DType::BF16; }),
            "version 2: rank 1 reports tensor layers.2.weight as BF16[6, 9], rank 0 as F32[6, 9]");
  EXPECT_EQ(with_table(1, [](auto& t) { t[1].full.name = "layers.1.bias"; }),
            "version 2: rank 1 reports tensor layers.1.bias where rank 0 has layers.1.weight");
  // Another rule on one rank (an explicit offset where rank 0 has Shard(0)): committed from the
  // tables when the placements tile, refused naming both ranks when they overlap.
  EXPECT_EQ(with_table(1, [](auto& t) { t[0].placement = offset_placement(24, 36), t[0].rule = {}; }),
            "version 2: tensor layers.0.weight: rank 0 and rank 1 overlap at position 24");
  // The same overlap said in the first round: rank 1's receipt gives an explicit placement.
  auto overlap = good;
  overlap[1].placements = {{0, offset_placement(24, 36)}};
  EXPECT_EQ(refused(overlap), "version 2: tensor layers.0.weight: rank 0 and rank 1 overlap at position 24");
  EXPECT_FALSE(w.gathered_tables);
  auto gap = good;
  gap[0].placements = {{4, Placement{}}};  // the replicated tensor: nobody publishes it
  EXPECT_EQ(refused(gap), "version 2: tensor layers.4.weight: no part covers positions 0..6");
  auto missing = good;
  w.store->remove(missing[1].delta->key);
  EXPECT_EQ(refused(missing), "version 2: part " + w.store->describe(missing[1].delta->key) + " of rank 1 is missing from the store");
}

// A rank that failed is reported before anything else, in the first round (its receipt has no
// table to compare); a malformed or cut-short receipt is refused with one line.
TEST(ShardCommit, ReceiptsAreSmallBinaryAndStrict) {
  TempDir dir;
  World w(open_store(dir.path().string()), mixed_layout(), 4, "compact");
  ASSERT_TRUE(w.publish(1).committed);
  w.step(2);
  auto receipts = w.publish_parts(2);
  const PartReceipt& r = receipts[1];
  EXPECT_TRUE(r.placements.empty()) << "Shard(d) and Replicate() are rules: rank 0 derives them";
  const std::vector<uint8_t> bytes = receipt_to_bytes(r);
  const PartReceipt back = receipt_from_bytes(bytes, "receipt");
  EXPECT_EQ(back.delta->key, r.delta->key);
  EXPECT_EQ(back.delta->header_sha256, r.delta->header_sha256);
  EXPECT_EQ(back.changed, r.changed);
  EXPECT_EQ(back.table_hash, r.table_hash);
  EXPECT_EQ(back.coordinate, 1u);
  EXPECT_TRUE(back.partials.empty()) << "partials travel by the reduce";
  const std::vector<uint8_t> cut(bytes.begin(), bytes.end() - 1);
  EXPECT_EQ(error_message([&] { receipt_from_bytes(cut, "receipt of rank 1"); }), "receipt of rank 1: the receipt is cut short");
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  EXPECT_EQ(error_message([&] { receipt_from_bytes(longer, "receipt of rank 1"); }), "receipt of rank 1: the receipt has 1 bytes after its end");
  // Partials summed as halves: a wrap past 2^64 comes back mod 2^64.
  const std::vector<uint64_t> a{~uint64_t{0}, 5}, b{2, uint64_t{1} << 63};
  std::vector<int64_t> sums = split_partials(a);
  const std::vector<int64_t> hb = split_partials(b);
  for (size_t i = 0; i < sums.size(); ++i) sums[i] += hb[i];
  EXPECT_EQ(join_partials(sums, 2, "sums"), (std::vector<uint64_t>{1, 5 + (uint64_t{1} << 63)}));
}

TEST(ShardRead, AnchorSlicesMustMatchTheirDigestsAndTileTheirTensor) {
  const TensorMeta meta{"w", DType::BF16, {4, 3}};
  const auto bits = random_bytes(24, 5);
  const Placement top = shard_placement(meta.shape, 0, 0, 2), bottom = shard_placement(meta.shape, 0, 1, 2);
  auto part = [&](const Placement& p, const std::string& label) {
    std::vector<uint8_t> local(p.numel() * 2);
    for (uint64_t k = 0; k < p.numel(); ++k) std::memcpy(&local[k * 2], &bits[p.full_position(k) * 2], 2);
    const std::span<const uint8_t> span(local);
    return st::File::from_bytes(serialize_anchor_slices(std::span(&meta, 1), std::span(&p, 1), std::span(&span, 1), 7, label), label);
  };
  const st::File a = part(top, "a"), b = part(bottom, "b");
  const st::File* both[] = {&a, &b};
  const AssembledTensors whole = assemble_anchor_slices(both, "anchor of version 7");
  ASSERT_EQ(whole.tensors.size(), 1u);
  EXPECT_EQ(whole.tensors[0].shape, meta.shape);
  EXPECT_TRUE(whole.storage[0] == bits);
  const st::File* twice[] = {&a, &a, &b};
  EXPECT_EQ(error_message([&] { assemble_anchor_slices(twice, "anchor of version 7"); }),
            "anchor of version 7: tensor w: part a and part a overlap at position 0");
  const st::File* alone[] = {&a};
  EXPECT_EQ(error_message([&] { assemble_anchor_slices(alone, "anchor of version 7"); }),
            "anchor of version 7: tensor w: no part covers positions 6..11");
  // The same tensor table and digests over other bytes.
  std::vector<uint8_t> other(a.bytes(a.at("w")).begin(), a.bytes(a.at("w")).end());
  other[0] ^= 1;
  const st::File forged = st::File::from_bytes(st::serialize(std::vector<st::WriteTensor>{{"w", DType::BF16, {6}, other}}, a.metadata()), "forged");
  const st::File* bad[] = {&forged, &b};
  EXPECT_EQ(error_message([&] { assemble_anchor_slices(bad, "anchor of version 7"); }),
            "forged: slice of tensor w does not match its recorded digest");
}

// An anchor of slices streams: tensors come out a group at a time, assembled from every part's
// slices (ranged reads), each exactly once and bit-exact, each group at most half the largest
// part (or one larger tensor); a tampered slice, a part whose table disagrees with its bytes
// (the manifest naming the altered part) and a missing part are each refused with one line
// naming the part.
TEST(ShardRead, AnAnchorOfSlicesStreamsAGroupOfTensorsAtATime) {
  TempDir dir;
  std::vector<Layout> layout = mixed_layout();
  for (int k = 0; k < 6; ++k) layout.push_back({{16, 8}, DType::BF16, k % 2});  // more tensors than a group holds
  World w(open_store(dir.path().string()), layout, 4, "compact");
  ASSERT_TRUE(w.publish(1).committed);
  auto store = open_store(dir.path().string());
  Subscriber sub(*store);
  ASSERT_EQ(sub.poll(), 1u);
  const protocol::Manifest manifest = *sub.catalog().find(1);
  uint64_t largest_part = 0, largest_tensor = 0;
  for (const auto& p : manifest.anchor_parts) largest_part = std::max(largest_part, p.size);
  for (const auto& m : w.meta) largest_tensor = std::max(largest_tensor, m.numel() * m.width());
  std::map<std::string, std::vector<uint8_t>> got;
  size_t groups = 0;
  const SyncReport report = sub.stream_anchor(1, [&](std::span<const TensorMeta> meta, std::span<const std::span<const uint8_t>> bytes,
                                                     std::span<const uint64_t> digests) {
    ++groups;
    uint64_t group = 0;
    for (size_t t = 0; t < meta.size(); ++t) {
      EXPECT_TRUE(got.emplace(meta[t].name, std::vector<uint8_t>(bytes[t].begin(), bytes[t].end())).second) << meta[t].name << " twice";
      EXPECT_EQ(digest_to_hex(digests[t]), manifest.digests.at(meta[t].name)) << meta[t].name;
      group += bytes[t].size();
    }
    EXPECT_LE(group, std::max(largest_part / 2, largest_tensor));
  });
  EXPECT_GT(groups, 1u);
  EXPECT_EQ(report.anchor, 1u);
  ASSERT_EQ(got.size(), w.meta.size());
  for (size_t t = 0; t < w.meta.size(); ++t) EXPECT_TRUE(got.at(w.meta[t].name) == w.full[t]) << w.meta[t].name;

  // A receiver that streams anchors (host tensors through the CPU engine) takes it the same way.
  std::vector<std::vector<uint8_t>> mine(w.meta.size());
  std::vector<TensorRef> targets;
  for (size_t t = 0; t < w.meta.size(); ++t) {
    mine[t].assign(w.full[t].size(), 0);
    targets.push_back(TensorRef{w.meta[t].name, mine[t].data(), w.meta[t].numel(), w.meta[t].width()});
  }
  engine::CpuSyncEngine engine;
  TensorReceiver receiver(w.meta, targets, engine);
  Subscriber fresh(*store);
  fresh.sync(receiver);
  for (size_t t = 0; t < w.meta.size(); ++t) EXPECT_TRUE(mine[t] == w.full[t]) << w.meta[t].name;

  // Bad input, each in a copy of the store.
  std::vector<std::filesystem::path> parts;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir.path()))
    if (e.path().string().find("/anchors/") != std::string::npos && e.path().extension() == ".safetensors") parts.push_back(e.path());
  std::sort(parts.begin(), parts.end());
  ASSERT_EQ(parts.size(), 4u);
  auto broken = [&](auto&& damage) {
    TempDir copy;
    std::filesystem::copy(dir.path(), copy.path(), std::filesystem::copy_options::recursive);
    // The manifest's last part: the stream reads its slices before the part's SHA-256 can be
    // checked (each rank's part has a nonce of its own, so sorted paths are in no fixed order).
    const std::filesystem::path part = copy.path() / manifest.anchor_parts.back().key;
    damage(copy.path(), part);
    auto s = open_store(copy.path().string());
    Subscriber reader(*s);
    reader.poll();
    const std::string error = error_message([&] { reader.stream_anchor(1, [](auto, auto, auto) {}); });
    return std::make_pair(error, part.filename().string());
  };
  auto read_file = [](const std::filesystem::path& p) {
    std::ifstream f(p, std::ios::binary);
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
  };
  auto write_file = [](const std::filesystem::path& p, const std::vector<uint8_t>& bytes) {
    std::ofstream(p, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  };
  {
    auto [error, name] = broken([&](const std::filesystem::path&, const std::filesystem::path& part) {
      auto bytes = read_file(part);
      bytes[bytes.size() - 3] ^= 1;
      write_file(part, bytes);
    });
    EXPECT_NE(error.find(name), std::string::npos) << error;
    EXPECT_NE(error.find("does not match its recorded digest"), std::string::npos) << error;
    EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  }
  {
    auto [error, name] = broken([&](const std::filesystem::path&, const std::filesystem::path& part) { std::filesystem::remove(part); });
    EXPECT_NE(error.find(name), std::string::npos) << error;
  }
  {
    // Two slices of equal size trade places in the part's table; the manifest names the new part.
    auto [error, name] = broken([&](const std::filesystem::path& root, const std::filesystem::path& part) {
      const st::File file = st::File::open(part.string());
      std::vector<st::WriteTensor> tensors;
      for (const auto& ti : file.tensors()) tensors.push_back({ti.name, ti.dtype, ti.shape, file.bytes(ti)});
      size_t a = tensors.size(), b = tensors.size();
      for (size_t i = 0; i < tensors.size() && b == tensors.size(); ++i)
        for (size_t j = i + 1; j < tensors.size(); ++j)
          if (tensors[i].bytes.size() == tensors[j].bytes.size() && tensors[i].dtype == tensors[j].dtype && !tensors[i].bytes.empty() &&
              !std::equal(tensors[i].bytes.begin(), tensors[i].bytes.end(), tensors[j].bytes.begin())) {
            a = i, b = j;
            break;
          }
      ASSERT_LT(b, tensors.size());
      std::swap(tensors[a].bytes, tensors[b].bytes);
      const auto old_bytes = read_file(part);
      const auto new_bytes = st::serialize(tensors, file.metadata());
      write_file(part, new_bytes);
      for (const auto& e : std::filesystem::recursive_directory_iterator(root)) {
        if (e.path().extension() != ".json") continue;
        const auto text_bytes = read_file(e.path());
        std::string text(text_bytes.begin(), text_bytes.end());
        const std::string old_sha = sha256_hex(old_bytes), old_size = std::to_string(old_bytes.size());
        if (text.find(old_sha) == std::string::npos) continue;
        text.replace(text.find(old_sha), old_sha.size(), sha256_hex(new_bytes));
        write_file(e.path(), std::vector<uint8_t>(text.begin(), text.end()));
      }
    });
    EXPECT_NE(error.find(name), std::string::npos) << error;
    EXPECT_NE(error.find("does not match its recorded digest"), std::string::npos) << error;
  }
}

// Weights that are not in host memory (a GPU) take compact parts unbased and rebase them on
// their own bits: the same path on the CPU engine, driven by hand.
TEST(ShardRead, UnbasedCompactPartsRebaseOnTheReceiversBits) {
  TempDir dir;
  World w(open_store(dir.path().string()), mixed_layout(), 2, "compact");
  ASSERT_TRUE(w.publish(1).committed);
  std::vector<std::vector<uint8_t>> memory;
  std::vector<TensorRef> targets;
  for (size_t t = 0; t < w.meta.size(); ++t) memory.emplace_back(w.full[t].size(), 0);
  for (size_t t = 0; t < w.meta.size(); ++t) targets.push_back(TensorRef{w.meta[t].name, memory[t].data(), w.meta[t].numel(), w.meta[t].width()});
  engine::CpuSyncEngine engine;
  TensorReceiver receiver(w.meta, targets, engine);
  Subscriber sub(*w.store);
  ASSERT_EQ(sub.sync(receiver).to, 1u);
  w.step(2);
  ASSERT_TRUE(w.publish(2).committed);
  protocol::Catalog catalog(*w.store);
  const protocol::Manifest m = *catalog.find(2);
  std::vector<st::File> files;
  for (const auto& p : m.delta_parts) files.push_back(st::File::from_bytes(w.store->get(p.object.key), p.object.key));
  const CombinedDelta combined = combine_delta_parts(m, files, w.meta, {});
  ASSERT_TRUE(combined.relative);
  engine::TransferCounters transfer;
  EXPECT_EQ(receiver.apply_patches(combined.patches, combined.digests, true, transfer), m.changed_elements);
  for (size_t t = 0; t < w.meta.size(); ++t) EXPECT_TRUE(memory[t] == w.full[t]) << w.meta[t].name;
  EXPECT_EQ(receiver.version(), 2u);
}

// The inference-engine receiver (runtime parameters reached through runs) goes through the same
// combination: here its parameters are the HF tensors one to one, on one rank.
class MappedFollows : public ::testing::TestWithParam<std::string> {};

TEST_P(MappedFollows, TheMappedReceiverFollowsAShardedPublisher) {
  TempDir dir;
  World w(open_store(dir.path().string()), mixed_layout(), 4, GetParam());
  std::vector<std::vector<uint8_t>> memory;
  MappedModel mm;
  mm.hf = w.meta;
  mm.params_meta = w.meta;
  for (size_t t = 0; t < w.meta.size(); ++t) memory.emplace_back(w.full[t].size(), 0);
  for (size_t t = 0; t < w.meta.size(); ++t) {
    const auto n = static_cast<int64_t>(w.meta[t].numel());
    mm.params.push_back(TensorRef{w.meta[t].name, memory[t].data(), w.meta[t].numel(), w.meta[t].width()});
    mm.runs.push_back(MappedRuns{static_cast<uint32_t>(t), static_cast<uint32_t>(t), {0}, {n}, {0}});
    mm.owned.push_back(OwnedRanges{static_cast<uint32_t>(t), {0}, {n}});
  }
  engine::CpuSyncEngine engine;
  MappedReceiver receiver(std::move(mm), engine, [](std::span<uint64_t>) {});
  Subscriber sub(*w.store);
  for (uint64_t v = 1; v <= 4; ++v) {
    if (v > 1) w.step(v);
    ASSERT_TRUE(w.publish(v).committed);
    const auto report = sub.sync(receiver);
    EXPECT_EQ(report.to, v);
    EXPECT_EQ(report.plan.anchor_version.has_value(), v == 1);
    for (size_t t = 0; t < w.meta.size(); ++t) EXPECT_TRUE(memory[t] == w.full[t]) << w.meta[t].name << " at version " << v;
  }
}

// Compact parts reach it unbased (no host base bits) and are rebased where its bits live.
INSTANTIATE_TEST_SUITE_P(Layouts, MappedFollows, ::testing::Values("trl", "compact"));

// The reader's checks on a version's parts, from a real 2-rank version whose manifest is altered.
TEST(ShardRead, RefusesPartsThatOverlapLeaveAGapOrLeaveTheirPlacement) {
  TempDir dir;
  World w(open_store(dir.path().string()), mixed_layout(), 2, "trl");
  ASSERT_TRUE(w.publish(1).committed);
  w.step(2);
  ASSERT_TRUE(w.publish(2).committed);
  protocol::Catalog catalog(*w.store);
  const protocol::Manifest m = *catalog.find(2);
  ASSERT_EQ(m.delta_parts.size(), 2u);
  std::vector<st::File> files;
  for (const auto& p : m.delta_parts) files.push_back(st::File::from_bytes(w.store->get(p.object.key), p.object.key));
  const CombinedDelta good = combine_delta_parts(m, files, w.meta, {});
  EXPECT_FALSE(good.relative);  // the interoperable layout carries whole bits
  EXPECT_GT(good.changed_elements, 0u);
  EXPECT_EQ(good.changed_elements, m.changed_elements);
  const std::string name = "layers.0.weight";
  // The manifest with part `part`'s placement of `tensor` replaced.
  auto placed = [&](protocol::Manifest changed, const std::string& tensor, size_t part, const Placement& p) {
    std::vector<Placement> per_part = protocol::expand(*changed.part_placements.find(tensor), changed.delta_parts.size());
    per_part[part] = p;
    changed.part_placements.set(tensor, protocol::pattern_of(per_part));
    return changed;
  };
  EXPECT_EQ(error_message([&] { combine_delta_parts(placed(m, name, 1, offset_placement(24, 36)), files, w.meta, {}); }),
            "version 2: tensor " + name + ": part " + m.delta_parts[0].object.key + " and part " + m.delta_parts[1].object.key +
                " overlap at position 24");
  EXPECT_EQ(error_message([&] { combine_delta_parts(placed(m, name, 1, Placement{}), files, w.meta, {}); }),
            "version 2: tensor " + name + ": no part covers positions 30..59");
  // Swapped placements: each part's positions lie outside what its entry says it holds.
  auto swapped_manifest = m;
  for (const auto& [tensor, pattern] : m.part_placements.tensors()) {
    std::vector<Placement> per_part = protocol::expand(m.part_placements.patterns()[pattern], 2);
    std::swap(per_part[0], per_part[1]);
    swapped_manifest.part_placements.set(tensor, protocol::pattern_of(per_part));
  }
  const std::string swapped = error_message([&] { combine_delta_parts(swapped_manifest, files, w.meta, {}); });
  EXPECT_NE(swapped.find(m.delta_parts[0].object.key + ": changes tensor "), std::string::npos) << swapped;
  EXPECT_NE(swapped.find("outside the placement"), std::string::npos) << swapped;
  // A compact part needs host weights to decode against.
}

// A part names only the tensors its rank changed (manifest format 3): in container layout 1 its
// tensor table, tensor_shapes, changed_params and digests grow with its changes, not with the
// model; in the indexed layout its header names no tensor and it holds one record per changed
// tensor. A rank that changed nothing uploads a part of no tensor (no record).
TEST(ShardRead, PartsNameOnlyTheTensorsTheyChange) {
  for (const uint32_t layout : {compact::kLayout1, compact::kLayout2}) {
    SCOPED_TRACE("compact_layout " + std::to_string(layout));
    TempDir dir;
    World w(open_store(dir.path().string()), mixed_layout(), 2, "compact", "", false, layout);
    ASSERT_TRUE(w.publish(1).committed);
    w.full[0][0] ^= 1;  // one element of layers.0.weight, in rank 0's rows
    ASSERT_TRUE(w.publish(2).committed);
    protocol::Catalog catalog(*w.store);
    const protocol::Manifest m = *catalog.find(2);
    ASSERT_EQ(m.delta_parts.size(), 2u);
    EXPECT_EQ(nlohmann::json::parse(to_json(m))["format_version"], 3);
    const st::File changed = st::File::from_bytes(w.store->get(m.delta_parts[0].object.key), "part 0");
    const st::File unchanged = st::File::from_bytes(w.store->get(m.delta_parts[1].object.key), "part 1");
    if (layout == compact::kLayout1) {
      EXPECT_EQ(changed.tensors().size(), 2u);  // layers.0.weight.cindex and .cdata
      EXPECT_EQ(changed.metadata().at("changed_params"), "[\"layers.0.weight\"]");
      EXPECT_EQ(nlohmann::json::parse(changed.metadata().at("tensor_shapes")).size(), 1u);
      EXPECT_EQ(nlohmann::json::parse(changed.metadata().at("base_digests")).size(), 1u);
      EXPECT_TRUE(unchanged.tensors().empty());
      EXPECT_EQ(nlohmann::json::parse(unchanged.metadata().at("tensor_shapes")).size(), 0u);
    } else {
      EXPECT_EQ(changed.at(compact::indexed::kRecords).nbytes(), compact::indexed::kRecordBytes);
      EXPECT_EQ(unchanged.at(compact::indexed::kRecords).nbytes(), 0u);
      EXPECT_EQ(changed.metadata().at(std::string(compact::indexed::kTableTensorsKey)), std::to_string(w.meta.size()));
      for (const st::File* f : {&changed, &unchanged}) {
        EXPECT_FALSE(f->metadata().contains("changed_params"));
        EXPECT_FALSE(f->metadata().contains("tensor_shapes"));
        EXPECT_FALSE(f->metadata().contains("base_digests"));
      }
    }
    EXPECT_FALSE(changed.metadata().contains(shard_keys::kUnchangedDigests));
    HostModel follower;
    Subscriber sub(*w.store);
    sub.sync(follower);
    expect_same_bits(follower, w);
  }
}

// The placements stay patterns in memory (never parts x tensors); an overlap is refused when the
// manifest is read and a tensor its parts leave short when they are combined: both before any
// byte of the receiver's weights is written.
TEST(ShardRead, TheUnexpandedManifestRefusesOverlapsAndGapsBeforeAnyByteIsWritten) {
  TempDir dir;
  World w(open_store(dir.path().string()), mixed_layout(), 2, "compact");
  ASSERT_TRUE(w.publish(1).committed);
  w.step(2);
  ASSERT_TRUE(w.publish(2).committed);
  std::vector<std::vector<uint8_t>> memory;
  std::vector<TensorRef> targets;
  for (size_t t = 0; t < w.meta.size(); ++t) memory.emplace_back(w.full[t].size(), 0);
  for (size_t t = 0; t < w.meta.size(); ++t) targets.push_back(TensorRef{w.meta[t].name, memory[t].data(), w.meta[t].numel(), w.meta[t].width()});
  engine::CpuSyncEngine engine;
  TensorReceiver receiver(w.meta, targets, engine);
  ASSERT_EQ(Subscriber(*w.store).sync(receiver).to, 2u);
  const auto at_two = memory;
  w.step(3);
  ASSERT_TRUE(w.publish(3).committed);
  const std::string key = protocol::manifest_key(3);
  const std::vector<uint8_t> raw = w.store->get(key);
  const nlohmann::json good = nlohmann::json::parse(raw.begin(), raw.end());
  {
    protocol::Catalog catalog(*w.store);
    const protocol::Manifest* m = catalog.find(3);
    // Five tensors, four placement patterns (two tensors cut alike would share one), no per-part maps.
    EXPECT_LE(m->part_placements.patterns().size(), w.meta.size());
    EXPECT_EQ(m->part_placements.tensors().size(), w.meta.size());
  }
  auto refused = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = good;
    edit(j);
    const std::string text = j.dump(1);
    w.store->put(key, std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
    Subscriber sub(*w.store);
    const std::string error = error_message([&] { sub.sync(receiver); });
    EXPECT_EQ(receiver.version(), 2u);
    EXPECT_TRUE(memory == at_two) << "bytes were written before the refusal: " << error;
    return error;
  };
  auto pattern_of_tensor = [](nlohmann::json& j, const char* tensor) -> nlohmann::json& {
    return j["part_placements"]["patterns"][j["part_placements"]["tensors"][tensor].get<size_t>()];
  };
  // layers.0.weight, 10 x 6 over 2 ranks: one segment [0, 2, 0, 30, 30, 30, 1].
  const std::string overlap = refused([&](nlohmann::json& j) { pattern_of_tensor(j, "layers.0.weight")[0][3] = 24; });
  EXPECT_NE(overlap.find("tensor layers.0.weight: part "), std::string::npos) << overlap;
  EXPECT_NE(overlap.find("overlap at position 24"), std::string::npos) << overlap;
  const std::string gap = refused([&](nlohmann::json& j) { pattern_of_tensor(j, "layers.0.weight")[0][1] = 1; });
  EXPECT_EQ(gap.rfind("version 3: tensor layers.0.weight: no part covers positions 30..59", 0), 0u) << gap;
  // Put back, the version applies.
  const std::string text = good.dump(1);
  w.store->put(key, std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
  EXPECT_EQ(Subscriber(*w.store).sync(receiver).to, 3u);
  for (size_t t = 0; t < w.meta.size(); ++t) EXPECT_TRUE(memory[t] == w.full[t]) << w.meta[t].name;
}

}  // namespace

// ---- fencing: the group claims once and every version carries its fence ---------------------

namespace {

std::map<std::string, std::string> store_bytes(const std::filesystem::path& root) {
  std::map<std::string, std::string> out;
  if (!std::filesystem::exists(root)) return out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root))
    if (e.is_regular_file()) {
      std::ifstream in(e.path(), std::ios::binary);
      out[std::filesystem::relative(e.path(), root).string()] = std::string(std::istreambuf_iterator<char>(in), {});
    }
  return out;
}

}  // namespace

TEST(ShardFence, EveryCommittedVersionKeepsTheGroupsFenceInLatestAndItsManifest) {
  TempDir dir;
  World w(open_store(dir.path().string()), mixed_layout(), 2, "compact", "a");
  for (const auto& r : w.ranks) EXPECT_EQ(r->fence(), (protocol::Fence{"a", 1, std::nullopt}));
  for (uint64_t v = 1; v <= 2; ++v) {
    if (v > 1) w.step(v);
    ASSERT_TRUE(w.publish(v).committed);
    const auto latest = protocol::read_latest_pointer(*w.store);
    ASSERT_TRUE(latest);
    EXPECT_EQ(latest->version, v);
    EXPECT_EQ(latest->fence, w.ranks[0]->fence()) << "LATEST lost the group's fence at version " << v;
    protocol::Catalog catalog(*w.store);
    EXPECT_EQ(catalog.find(v)->fence, w.ranks[0]->fence());
  }
}

TEST(ShardFence, AnotherRunIsRefusedOnEveryRankWritingNothingAndTakingOverStartsANewEpoch) {
  TempDir dir;
  {
    World a(open_store(dir.path().string()), mixed_layout(), 2, "compact", "a");
    ASSERT_TRUE(a.publish(1).committed);
  }
  const auto before = store_bytes(dir.path());
  std::shared_ptr<Store> store = open_store(dir.path().string());
  PublisherOptions o;
  o.run_id = "b";
  const ClaimOutcome refused = claim_for_group(*store, o);
  EXPECT_FALSE(refused.fence);
  EXPECT_NE(refused.error.find("refusing to publish run b"), std::string::npos) << refused.error;
  const ClaimOutcome heard = claim_from_json(claim_to_json(refused), "claim");
  for (uint64_t r = 0; r < 2; ++r) {
    try {
      std::vector<ShardTensor> tensors{ShardTensor{TensorMeta{"w", DType::BF16, {4}}, whole_placement(4)}};
      ShardPublisher p(store, tensors, r, heard, std::make_unique<engine::CpuSyncEngine>());
      ADD_FAILURE() << "rank " << r << " was not refused";
    } catch (const protocol::FencedError& e) {
      EXPECT_EQ(std::string(e.what()), refused.error);
    }
  }
  EXPECT_EQ(store_bytes(dir.path()), before) << "a refused group wrote into the store";
  World b(open_store(dir.path().string()), mixed_layout(), 2, "compact", "b", /*take_over=*/true);
  EXPECT_EQ(b.ranks[1]->fence(), (protocol::Fence{"b", 2, 1}));
  ASSERT_TRUE(b.publish(2).committed);
  EXPECT_EQ(protocol::read_latest_pointer(*store)->fence, b.ranks[0]->fence());
}

TEST(ShardFence, AZombieGroupIsRefusedAndNothingItWritesBecomesVisible) {
  TempDir dir;
  World old_group(open_store(dir.path().string()), mixed_layout(), 2, "compact", "r");
  ASSERT_TRUE(old_group.publish(1).committed);
  old_group.step(2);
  // The old group uploads its parts of version 2, having passed the fence check...
  auto receipts = old_group.publish_parts(2);
  // ... and is partitioned while the run restarts: a new epoch since version 1.
  World restarted(open_store(dir.path().string()), mixed_layout(), 2, "compact", "r");
  EXPECT_EQ(restarted.ranks[0]->fence(), (protocol::Fence{"r", 2, 1}));
  const CommitOutcome out = old_group.commit(receipts, 1);
  EXPECT_FALSE(out.committed);
  EXPECT_TRUE(out.fenced);
  EXPECT_NE(out.error.find("was fenced off"), std::string::npos) << out.error;
  EXPECT_FALSE(old_group.store->head(protocol::manifest_key(2)));
  const CommitOutcome heard = outcome_from_json(outcome_to_json(out), "outcome");
  for (auto& r : old_group.ranks) {
    r->conclude(heard);
    EXPECT_EQ(r->fenced(), out.error);
  }
  // From then on every rank of the old group refuses to publish, uploading nothing.
  const auto before = store_bytes(dir.path());
  for (uint64_t r = 0; r < 2; ++r) {
    const auto bytes = old_group.local(r);
    std::vector<ConstTensorRef> refs;
    for (size_t t = 0; t < old_group.meta.size(); ++t)
      refs.push_back(ConstTensorRef{old_group.meta[t].name, bytes[t].data(), bytes[t].size() / old_group.meta[t].width(), old_group.meta[t].width()});
    EXPECT_THROW(old_group.ranks[r]->publish_part(3, refs, true), protocol::FencedError);
    EXPECT_TRUE(old_group.ranks[r]->failed(3, "x").fenced);
  }
  EXPECT_EQ(store_bytes(dir.path()), before);
  // The restarted group publishes on; a follower sees only its versions.
  restarted.full = old_group.full;
  ASSERT_TRUE(restarted.publish(2).committed);
  EXPECT_EQ(protocol::read_latest_pointer(*restarted.store)->fence, restarted.ranks[0]->fence());
  HostModel follower;
  auto reader_store = open_store(dir.path().string());
  Subscriber sub(*reader_store);
  EXPECT_EQ(sub.sync(follower).to, 2u);
  expect_same_bits(follower, restarted);
}

TEST(ShardFence, RanksThatFindTheFenceGoneUploadNothingAndTheCommitIsFenced) {
  TempDir dir;
  World w(open_store(dir.path().string()), mixed_layout(), 2, "compact", "r");
  ASSERT_TRUE(w.publish(1).committed);
  World newer(open_store(dir.path().string()), mixed_layout(), 2, "compact", "r");  // a restart elsewhere
  const auto before = store_bytes(dir.path());
  w.step(2);
  std::vector<PartReceipt> receipts;
  for (uint64_t r = 0; r < 2; ++r) {
    const auto bytes = w.local(r);
    std::vector<ConstTensorRef> refs;
    for (size_t t = 0; t < w.meta.size(); ++t)
      refs.push_back(ConstTensorRef{w.meta[t].name, bytes[t].data(), bytes[t].size() / w.meta[t].width(), w.meta[t].width()});
    try {
      receipts.push_back(w.ranks[r]->publish_part(2, refs, false));
      ADD_FAILURE() << "rank " << r << " uploaded past its fence";
    } catch (const protocol::FencedError& e) {
      receipts.push_back(w.ranks[r]->failed(2, e.what()));
    }
  }
  EXPECT_EQ(store_bytes(dir.path()), before) << "a fenced-off rank uploaded";
  const CommitOutcome out = w.commit(receipts, 1);
  EXPECT_FALSE(out.committed);
  EXPECT_TRUE(out.fenced);
  EXPECT_EQ(out.error.rfind("version 2: rank 0: ", 0), 0u) << out.error;
  EXPECT_EQ(store_bytes(dir.path()), before);
}

// ---- a restarted group resumes from the store (sync/shard_resume.hpp) -------------------------

// The all-gather of the recovery receipts (through the wire form) and the all-reduce of their
// partials (as int64 halves), then every rank's adopt(): what each returned, or the line it threw.
std::vector<std::string> adopt_all(World& w, const std::vector<PartReceipt>& receipts) {
  std::vector<PartReceipt> gathered;
  std::vector<int64_t> sums(2 * w.meta.size(), 0);
  for (const auto& r : receipts) {
    gathered.push_back(receipt_from_bytes(receipt_to_bytes(r), "resume receipt"));
    const std::vector<int64_t> halves = split_partials(r.partials);
    for (size_t i = 0; i < halves.size(); ++i) sums[i] += halves[i];
  }
  const std::vector<uint64_t> digests = join_partials(sums, w.meta.size(), "sums");
  // A table or rules hash that differs: every rank's table, all-gathered too (the same verdict everywhere).
  std::vector<std::vector<ShardTensor>> tables;
  w.gathered_tables = tables_needed(gathered, w.ranks[0]->tensors());
  if (w.gathered_tables)
    for (auto& r : w.ranks) tables.push_back(table_from_bytes(table_to_bytes(r->tensors()), "table"));
  std::vector<std::string> verdicts;
  for (auto& r : w.ranks) {
    try {
      const std::optional<uint64_t> since = r->adopt(gathered, digests, tables);
      verdicts.push_back(since ? "resumed from " + std::to_string(*since) : "nothing to resume");
    } catch (const Error& e) {
      verdicts.push_back(e.what());
    }
  }
  return verdicts;
}

// Every rank's recover(), then adopt_all.
std::vector<std::string> resume_group(World& w) {
  std::vector<PartReceipt> receipts;
  for (auto& r : w.ranks) receipts.push_back(r->recover());
  return adopt_all(w, receipts);
}

class ShardResume : public ::testing::TestWithParam<std::tuple<uint64_t, uint64_t, std::string>> {};

TEST_P(ShardResume, ARestartedGroupOfAnyWorldSizeRecoversItsShardsAndPublishesADelta) {
  const auto [before, after, format] = GetParam();
  TempDir dir;
  World w(open_store(dir.path().string()), mixed_layout(), before, format);
  auto reader_store = open_store(dir.path().string());
  Subscriber sub(*reader_store);
  HostModel follower;
  for (uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) w.step(v);
    ASSERT_TRUE(w.publish(v).committed);
  }
  sub.sync(follower);
  // The restart: the trainers' own checkpoint of version 3 (a new epoch since 3), shadows empty.
  World restarted(open_store(dir.path().string()), mixed_layout(), after, format);
  restarted.full = w.full;
  EXPECT_EQ(resume_group(restarted), std::vector<std::string>(after, "resumed from 3"));
  uint64_t read = 0;
  for (auto& r : restarted.ranks) {
    EXPECT_EQ(r->state().last_version, std::optional<uint64_t>(3));
    EXPECT_EQ(r->state().last_anchor_version, std::optional<uint64_t>(1));
    EXPECT_FALSE(r->anchor_due(4));
    read += r->resume_counters().bytes_read;
  }
  EXPECT_GT(read, 0u);
  // Version 4 is the checkpoint unchanged: every shadow holds the store's bits, so it is an empty
  // delta the follower reaches by itself. Version 5 after a step: the schedule's anchor (every 4
  // since version 1) with its delta from 4.
  for (uint64_t v = 4; v <= 5; ++v) {
    if (v == 5) restarted.step(v);
    const CommitOutcome out = restarted.publish(v);
    ASSERT_TRUE(out.committed) << out.error;
    EXPECT_EQ(out.anchor, v == 5);
    EXPECT_EQ(out.changed_elements == 0, v == 4);
    const SyncReport report = sub.sync(follower);
    EXPECT_EQ(report.to, v);
    if (v == 4) EXPECT_FALSE(report.plan.anchor_version) << "version 4 is reached by its delta";
    expect_same_bits(follower, restarted);
  }
  HostModel late;
  Subscriber(*reader_store).sync(late);
  expect_same_bits(late, restarted);
}

// Same sharding, fewer ranks, more ranks, one rank (its parts are the single form), in both layouts.
INSTANTIATE_TEST_SUITE_P(WorldSizes, ShardResume,
                         ::testing::Values(std::make_tuple(2u, 2u, "compact"), std::make_tuple(4u, 3u, "compact"),
                                           std::make_tuple(2u, 4u, "trl"), std::make_tuple(1u, 3u, "compact"),
                                           std::make_tuple(3u, 1u, "trl")));

TEST(ShardResume, ReadsOnlyTheRanksOwnPartsWhenTheShardingIsTheSame) {
  TempDir dir;
  World w(open_store(dir.path().string()), mixed_layout(), 4, "compact");
  for (uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) w.step(v);
    ASSERT_TRUE(w.publish(v).committed);
  }
  World restarted(open_store(dir.path().string()), mixed_layout(), 4, "compact");
  ASSERT_EQ(resume_group(restarted), std::vector<std::string>(4, "resumed from 3"));
  protocol::Catalog catalog(*w.store);
  const protocol::Manifest* anchor = catalog.find(1);
  for (uint64_t r = 0; r < 4; ++r) {
    const ResumeCounters c = restarted.ranks[r]->resume_counters();
    // Its anchor part and its delta parts of versions 2 and 3, whole; every anchor part's header.
    EXPECT_EQ(c.whole_objects, 3u) << "rank " << r;
    EXPECT_EQ(c.ranged_reads, 0u) << "rank " << r;
    EXPECT_EQ(c.header_reads, 2 * anchor->anchor_parts.size());
    uint64_t own = anchor->anchor_parts[r].size;
    for (uint64_t v : {2u, 3u}) own += catalog.find(v)->delta_parts[r].object.size;
    EXPECT_LT(c.bytes_read, own + 4096 * anchor->anchor_parts.size()) << "rank " << r;
  }
}

TEST(ShardResume, ResumesFromASingleProcessPublishersStore) {
  TempDir dir;
  std::shared_ptr<Store> store = open_store(dir.path().string());
  World shape(store, mixed_layout(), 1, "compact", "single");  // the tensors and the weights only
  {
    PublisherOptions o;
    o.run_id = "single";
    o.take_over = true;
    o.anchor_part_bytes = 64;  // several whole-tensor anchor parts
    Publisher p(store, shape.meta, o);
    for (uint64_t v = 1; v <= 3; ++v) {
      if (v > 1) shape.step(v);
      std::vector<ConstTensorRef> refs;
      for (size_t t = 0; t < shape.meta.size(); ++t)
        refs.push_back(ConstTensorRef{shape.meta[t].name, shape.full[t].data(), shape.meta[t].numel(), shape.meta[t].width()});
      p.publish(v, refs, v == 1);
    }
    p.flush();
  }
  World restarted(store, mixed_layout(), 2, "compact", "single");
  restarted.full = shape.full;
  ASSERT_EQ(resume_group(restarted), std::vector<std::string>(2, "resumed from 3"));
  const CommitOutcome out = restarted.publish(4);
  ASSERT_TRUE(out.committed) << out.error;
  EXPECT_FALSE(out.anchor);
  EXPECT_EQ(out.changed_elements, 0u);
  HostModel follower;
  Subscriber(*store).sync(follower);
  expect_same_bits(follower, restarted);
}

TEST(ShardResume, AFailedRankOrADigestMismatchRefusesOnEveryRankWithOneLineWritingNothing) {
  TempDir dir;
  World w(open_store(dir.path().string()), mixed_layout(), 2, "compact");
  for (uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) w.step(v);
    ASSERT_TRUE(w.publish(v).committed);
  }
  protocol::Catalog catalog(*w.store);
  const std::string key = catalog.find(3)->delta_parts[1].object.key;
  std::vector<uint8_t> bytes = w.store->get(key);
  bytes[bytes.size() - 3] ^= 1;
  w.store->put(key, bytes);
  World restarted(open_store(dir.path().string()), mixed_layout(), 2, "compact");
  const auto before = store_bytes(dir.path());
  const auto verdicts = resume_group(restarted);
  EXPECT_EQ(verdicts[0], verdicts[1]);
  EXPECT_EQ(verdicts[0], "resume from version 3: rank 1 failed: " + w.store->describe(key) + ": sha256 differs from the manifest's (corrupt object)");
  EXPECT_EQ(store_bytes(dir.path()), before);
  for (auto& r : restarted.ranks) EXPECT_TRUE(r->anchor_due(4)) << "a refused resume must leave the rank as it was";

  // Receipts whose partials do not add up to the manifest's digests (a rank that recovered wrong bits).
  w.store->put(key, [&] { bytes[bytes.size() - 3] ^= 1; return bytes; }());
  World again(open_store(dir.path().string()), mixed_layout(), 2, "compact");
  std::vector<PartReceipt> receipts;
  for (auto& r : again.ranks) receipts.push_back(r->recover());
  receipts[1].partials[0] += 1;
  for (const std::string& verdict : adopt_all(again, receipts))
    EXPECT_EQ(verdict.rfind("resume from version 3: tensor layers.0.weight: the ranks' recovered shards sum to digest ", 0), 0u) << verdict;
}

// A rank whose placements come from no rule (explicit, as plain per-rank tensors with offsets)
// where the others have Shard(d): its receipt's rules hash differs from rank 0's, so the tables
// are gathered -- at the resume's all-gather and at every commit -- and the group resumes and
// publishes on from the placements they list.
TEST(ShardResume, ARankWithoutRulesResumesAndPublishesThroughTheTables) {
  TempDir dir;
  World w(open_store(dir.path().string()), mixed_layout(), 2, "compact");
  for (uint64_t v = 1; v <= 3; ++v) {
    if (v > 1) w.step(v);
    ASSERT_TRUE(w.publish(v).committed);
  }
  World restarted(open_store(dir.path().string()), mixed_layout(), 2, "compact");
  restarted.full = w.full;
  std::vector<ShardTensor> tensors = restarted.ranks[1]->tensors();
  for (ShardTensor& t : tensors) t.rule = {};  // the same placements, given explicitly
  restarted.ranks[1] = std::make_unique<ShardPublisher>(restarted.store, tensors, 1, ClaimOutcome{restarted.ranks[0]->fence(), ""},
                                                        std::make_unique<engine::CpuSyncEngine>(), restarted.ranks[0]->options());
  EXPECT_EQ(resume_group(restarted), std::vector<std::string>(2, "resumed from 3"));
  EXPECT_TRUE(restarted.gathered_tables);
  restarted.step(4);
  const CommitOutcome out = restarted.publish(4);
  ASSERT_TRUE(out.committed) << out.error;
  EXPECT_TRUE(restarted.gathered_tables);
  EXPECT_FALSE(out.anchor);
  HostModel follower;
  Subscriber(*restarted.store).sync(follower);
  expect_same_bits(follower, restarted);
}

// A store written before manifest format 3 -- parts naming every tensor of the model in
// tensor_shapes, with the rank's partials of the tensors it held unchanged (unchanged_digests),
// under a format 2 manifest -- reads bit-exactly as before, from the version before and from
// nothing, in both layouts.
class OldStores : public ::testing::TestWithParam<std::string> {};

TEST_P(OldStores, PartsWrittenInTheOldFormAreStillRead) {
  const std::string format = GetParam();
  TempDir dir;
  World w(open_store(dir.path().string()), mixed_layout(), 2, format);
  ASSERT_TRUE(w.publish(1).committed);
  HostModel follower;
  Subscriber sub(*w.store);
  sub.sync(follower);
  const std::vector<std::vector<uint8_t>> before = w.full;
  w.step(2);
  ASSERT_TRUE(w.publish(2).committed);
  // Version 2 rewritten as the publisher wrote it before: every part over the whole model.
  protocol::Catalog catalog(*w.store);
  protocol::Manifest m = *catalog.find(2);
  std::vector<ConstTensorRef> base;
  for (size_t t = 0; t < w.meta.size(); ++t) base.push_back(ConstTensorRef{w.meta[t].name, before[t].data(), w.meta[t].numel(), w.meta[t].width()});
  for (size_t k = 0; k < m.delta_parts.size(); ++k) {
    const st::File file = st::File::from_bytes(w.store->get(m.delta_parts[k].object.key), "part");
    ResolvedDelta resolved;
    resolve_delta(file, w.meta, base, resolved);
    const integrity::DeltaDigests promised = *integrity::read_delta_digests(resolved.info, "part");
    SparseDelta all;  // every tensor of the model, the unchanged ones empty
    all.offsets.assign(1, 0);
    all.value_offsets.assign(1, 0);
    integrity::DigestMap unchanged;
    for (size_t t = 0; t < w.meta.size(); ++t) {
      const PatchRef& p = resolved.patches[t];
      const uint32_t width = w.meta[t].width();
      for (uint64_t i = 0; i < p.count; ++i) {
        const uint64_t at = patch_index(p, i);
        all.indices.push_back(static_cast<int64_t>(at));
        const auto* v = static_cast<const uint8_t*>(p.values) + i * width;
        all.values.insert(all.values.end(), v, v + width);
        all.base_values.insert(all.base_values.end(), before[t].begin() + at * width, before[t].begin() + (at + 1) * width);
      }
      all.offsets.push_back(all.indices.size());
      all.value_offsets.push_back(all.values.size());
      const Placement held = w.placement(t, k);
      if (p.count == 0 && !held.empty()) {
        std::vector<uint8_t> local(held.numel() * width);
        for (uint64_t i = 0; i < held.numel(); ++i) std::memcpy(&local[i * width], &before[t][held.full_position(i) * width], width);
        const ConstTensorRef ref{w.meta[t].name, local.data(), held.numel(), width};
        unchanged.emplace(w.meta[t].name, digest_placed_tensors(std::span(&ref, 1), std::span(&held, 1))[0]);
      }
    }
    DeltaInfo info;
    integrity::put_delta_digests(info, promised);
    if (!unchanged.empty()) integrity::put_digest_map(info.extra, shard_keys::kUnchangedDigests, unchanged);
    compact::Options layout1;  // the container parts had then
    layout1.layout = compact::kLayout1;
    const std::vector<uint8_t> old_form = serialize_delta(parse_delta_format(format), w.meta, all.view(), info, layout1);
    m.delta_parts[k].object =
        ranged::put_delta_object(*w.store, protocol::delta_key(2, protocol::new_nonce()), old_form, parse_delta_format(format));
    const st::File written = st::File::from_bytes(std::vector<uint8_t>(old_form), "old part");
    EXPECT_EQ(nlohmann::json::parse(written.metadata().at("tensor_shapes")).size(), w.meta.size());
  }
  nlohmann::json text = nlohmann::json::parse(to_json(m));
  text["format_version"] = 2;
  const std::string old_manifest = text.dump(1);
  w.store->put(protocol::manifest_key(2), std::span(reinterpret_cast<const uint8_t*>(old_manifest.data()), old_manifest.size()));
  // A follower at version 1, and a reader from nothing (anchor 1 then the old-form delta).
  EXPECT_EQ(sub.sync(follower).to, 2u);
  expect_same_bits(follower, w);
  HostModel fresh;
  auto reader_store = open_store(dir.path().string());
  Subscriber(*reader_store).sync(fresh);
  expect_same_bits(fresh, w);
  // A group resuming from it reads the old parts too.
  World restarted(open_store(dir.path().string()), mixed_layout(), 2, format);
  restarted.full = w.full;
  EXPECT_EQ(resume_group(restarted), std::vector<std::string>(2, "resumed from 2"));
}

INSTANTIATE_TEST_SUITE_P(Layouts, OldStores, ::testing::Values("compact", "trl"));
