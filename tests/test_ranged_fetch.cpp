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

#include "codec/compact_block_subset.hpp"
#include "codec/compact_codec.hpp"
#include "compact_test_support.hpp"
#include "engine/cpu_sync_engine.hpp"
#include "store/sha256.hpp"
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
    return compact::read_block_records(enc[0].block_index, enc[0].payload.size(), m.meta[0].numel(), "w");
  }
};

std::vector<compact::BlockRecord> blocks_at(std::initializer_list<uint64_t> firsts) {
  std::vector<compact::BlockRecord> out;
  for (uint64_t f : firsts) out.push_back(compact::BlockRecord{f, 0, 1, 0, 0, 0});
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
  const compact::BlockSubset subset = compact::build_block_subset(rec, chosen, payloads, e.m.meta[0].numel(), "w");

  const std::vector<compact::EncodedTensorView> views = {{"w", subset.block_index, subset.payload}};
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
  const uint64_t n = e.m.meta[0].numel();
  {
    const std::vector<uint32_t> chosen = {2};
    const std::vector<std::span<const uint8_t>> short_payload = {payload(2).first(payload(2).size() - 1)};
    EXPECT_NE(error_message([&] { compact::build_block_subset(rec, chosen, short_payload, n, "f: tensor w"); })
                  .find("f: tensor w: block 2: payload has"),
              std::string::npos);
  }
  {
    const std::vector<uint32_t> chosen = {3, 1};
    const std::vector<std::span<const uint8_t>> p = {payload(3), payload(1)};
    EXPECT_NE(error_message([&] { compact::build_block_subset(rec, chosen, p, n, "w"); }).find("out of order"), std::string::npos);
  }
  std::vector<uint8_t> truncated(e.enc[0].block_index.begin(), e.enc[0].block_index.end() - 1);
  EXPECT_NE(error_message([&] { compact::read_block_records(truncated, e.enc[0].payload.size(), n, "f: tensor w"); })
                .find("f: tensor w: block index has"),
            std::string::npos);
  EXPECT_NE(error_message([&] { compact::read_block_records(e.enc[0].block_index, e.enc[0].payload.size() + 1, n, "w"); })
                .find("payload has"),
            std::string::npos);
  EXPECT_NE(error_message([&] { compact::read_block_records(e.enc[0].block_index, e.enc[0].payload.size(), 10, "w"); })
                .find("outside the tensor"),
            std::string::npos);
}

TEST(BlockSubset, ABlockIsNeededWhenItsPositionSpanMeetsANeededSpan) {
  const auto blocks = blocks_at({0, 100, 200});  // spans [0,100) [100,200) [200,300)
  auto pick = [&](std::vector<ElementSpan> needed) { return compact::blocks_overlapping(blocks, 300, needed); };
  EXPECT_EQ(pick({}), std::vector<uint32_t>{});
  EXPECT_EQ(pick({{150, 160}}), std::vector<uint32_t>{1});
  EXPECT_EQ(pick({{99, 100}}), std::vector<uint32_t>{0});
  EXPECT_EQ(pick({{100, 101}}), std::vector<uint32_t>{1});
  EXPECT_EQ(pick({{99, 101}}), (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(pick({{0, 10}, {250, 300}}), (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(pick({{0, 300}}), (std::vector<uint32_t>{0, 1, 2}));
}

TEST(RangedPlan, RangesRoundOutToWholeChunksAndTouchingOnesMerge) {
  EXPECT_EQ(ranged::whole_chunks({{4096 + 5, 10}, {0, 10}, {8192, 1}}, 4096, 10000), (std::vector<ByteRange>{{0, 10000}}));
  EXPECT_EQ(ranged::whole_chunks({{0, 10}, {12288, 5}}, 4096, 20000), (std::vector<ByteRange>{{0, 4096}, {12288, 4096}}));
  EXPECT_EQ(ranged::whole_chunks({{100, 0}}, 4096, 20000), std::vector<ByteRange>{});
  EXPECT_EQ(ranged::whole_chunks({{19990, 10}}, 4096, 20000), (std::vector<ByteRange>{{16384, 3616}}));
  EXPECT_NE(error_message([] { ranged::whole_chunks({{19990, 11}}, 4096, 20000); }).find("runs past"), std::string::npos);
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

// A sealed compact delta of Encoded's tensor, as the publisher writes it, with its reference.
struct Sealed {
  Encoded e;
  std::vector<uint8_t> bytes;
  protocol::ObjectRef ref;
  Sealed() {
    DeltaInfo info;
    info.model_version = 2;
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
  EXPECT_EQ(h.chunk_bytes, 256u);
  EXPECT_EQ(h.chunk_sha256.size(), (h.data_bytes() + 255) / 256);
  EXPECT_FALSE(h.metadata.count(ranged::kChunkSha256Key));
  // The sealed file is still an ordinary compact delta with the same tensors.
  const st::File file = st::File::from_bytes(s.bytes, "d");
  EXPECT_TRUE(compact::is_compact_delta(file));
  EXPECT_EQ(file.tensors().size(), h.tensors.size());

  std::vector<uint8_t> header(s.prefix().begin(), s.prefix().end());
  header[20] ^= 1;
  EXPECT_EQ(error_message([&] { ranged::read_sealed_header(header, s.ref, "d"); }),
            "d: header sha256 differs from the manifest's (corrupt object)");
  std::vector<uint8_t> data(s.bytes.begin() + h.data_offset, s.bytes.end());
  EXPECT_NO_THROW(ranged::verify_chunks(h, 0, data, "d"));
  EXPECT_NO_THROW(ranged::verify_chunks(h, 512, std::span<const uint8_t>(data).subspan(512, 256), "d"));
  data[600] ^= 4;
  EXPECT_EQ(error_message([&] { ranged::verify_chunks(h, 512, std::span<const uint8_t>(data).subspan(512, 256), "d"); }),
            "d: data chunk 2 sha256 differs from its header's (corrupt object)");
  EXPECT_NE(error_message([&] { ranged::verify_chunks(h, 100, std::span<const uint8_t>(data).subspan(100, 256), "d"); })
                .find("not whole chunks"),
            std::string::npos);
}

TEST(RangedPlan, AReceiverOfHalfATensorReadsTheIndexAndOnlyTheBlocksThatMeetItsHalf) {
  Sealed s;
  const ranged::SealedHeader h = ranged::read_sealed_header(s.prefix(), s.ref, "d");
  const uint64_t n = s.e.m.meta[0].numel();
  const st::File file = st::File::from_bytes(s.bytes, "d");
  auto cindex = [&](const std::string& t) { return file.bytes(file.at(t + ".cindex")); };
  ranged::NeededRanges first_half{{"w", {n, {{0, n / 2}}}}};
  const ranged::ObjectReadPlan plan = ranged::plan_object_reads(h, first_half, {}, cindex, "d");
  ASSERT_EQ(plan.blocks.size(), 1u);
  const compact::BlockRecords rec = s.e.records();
  for (uint32_t b : plan.blocks[0].chosen) EXPECT_LT(rec.blocks[b].first_position, n / 2);
  EXPECT_EQ(plan.blocks[0].chosen.size(), compact::blocks_overlapping(rec.blocks, n, first_half.at("w").spans).size());
  EXPECT_LT(plan.bytes() - plan.header_bytes, h.data_bytes() * 7 / 10);  // a small file: the header is most of it
  for (const auto& r : plan.block_chunks) EXPECT_EQ(r.offset % 256, 0u);
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

// Two ranks on threads: each holds the rows of its half of every tensor (as tensor parallelism
// splits a column-parallel weight), owns them for digests, and sums partials with the other.
struct TwoRanks {
  std::vector<TensorMeta> hf;
  std::vector<std::vector<std::vector<uint8_t>>> memory;  // [rank][tensor]
  std::barrier<> sync_point{2};
  std::array<std::vector<uint64_t>, 2> partial;
  engine::CpuSyncEngine engines[2];
  std::vector<std::unique_ptr<MappedReceiver>> receivers;

  explicit TwoRanks(std::vector<TensorMeta> meta) : hf(std::move(meta)), memory(2) {
    for (int r = 0; r < 2; ++r) {
      MappedModel mm;
      mm.hf = hf;
      for (size_t t = 0; t < hf.size(); ++t) {
        const int64_t n = static_cast<int64_t>(hf[t].numel()), half = n / 2;
        const int64_t begin = r == 0 ? 0 : half, len = r == 0 ? half : n - half;
        memory[r].emplace_back(static_cast<size_t>(len) * hf[t].width(), 0);
        mm.params_meta.push_back(TensorMeta{hf[t].name, hf[t].dtype, {static_cast<uint64_t>(len)}});
        mm.params.push_back(TensorRef{hf[t].name, memory[r][t].data(), static_cast<uint64_t>(len), hf[t].width()});
        mm.runs.push_back(MappedRuns{static_cast<uint32_t>(t), static_cast<uint32_t>(t), {begin}, {len}, {0}});
        mm.owned.push_back(OwnedRanges{static_cast<uint32_t>(t), {begin}, {len}});
      }
      receivers.push_back(std::make_unique<MappedReceiver>(std::move(mm), engines[r], [this, r](std::span<uint64_t> v) {
        partial[r].assign(v.begin(), v.end());
        sync_point.arrive_and_wait();
        for (size_t i = 0; i < v.size(); ++i) v[i] = partial[0][i] + partial[1][i];
        sync_point.arrive_and_wait();
      }));
    }
  }

  // Both ranks sync (each its own subscriber); the reports, or the errors' messages.
  std::array<std::variant<SyncReport, std::string>, 2> sync(Store& store) {
    std::array<std::variant<SyncReport, std::string>, 2> out;
    auto run = [&](int r) {
      try {
        Subscriber sub(store);
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
        const uint64_t w = hf[t].width(), begin = r == 0 ? 0 : hf[t].numel() / 2;
        if (std::memcmp(memory[r][t].data(), full[t].data() + begin * w, memory[r][t].size()) != 0) return false;
      }
    return true;
  }
};

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

TEST(RangedSync, TwoRanksEachReadLessThanTheDeltaAndEndBitIdentical) {
  TempDir dir;
  auto store = std::shared_ptr<Store>(open_store(dir.path().string()));
  Trainer trainer;
  PublisherOptions o;
  o.anchor_every = 0;
  o.compact_block_elements = 256;
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
  // The rank whose block it is refuses (one line naming the object and chunk); the other rank is
  // refused by it in their agreement; the recovery from anchor 1 meets the same block again.
  ASSERT_TRUE(std::holds_alternative<std::string>(reports[1])) << "rank 1 accepted a tampered block";
  EXPECT_NE(std::get<std::string>(reports[1]).find("sha256 differs from its header's"), std::string::npos) << std::get<std::string>(reports[1]);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(std::holds_alternative<std::string>(reports[r])) << "rank " << r << " applied version 4";
    EXPECT_EQ(ranks.receivers[r]->version(), 3u);
  }
  EXPECT_TRUE(ranks.holds(trainer.bits));
}

// A store written by two trainer ranks (each the flat half of every tensor, as a delta part):
// each receiver rank reads both parts' headers (their digest partials), but the index and
// blocks of the part that holds its half only.
TEST(RangedSync, TwoRanksFollowingAShardedPublisherReadTheirPartsBlocksOnly) {
  TempDir dir;
  auto store = std::shared_ptr<Store>(open_store(dir.path().string()));
  Trainer trainer;
  PublisherOptions o;
  o.anchor_every = 0;
  o.compact_block_elements = 256;
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
