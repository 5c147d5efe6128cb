// Publisher and subscriber through a folder store: a reader following every version, a late
// reader, a reader whose weights were corrupted, a corrupt object in the store, merging when
// uploads fall behind, and an upload failure followed by success. Every reader must end bit
// for bit equal to the trainer's weights.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>

#include "engine/cpu_engine.hpp"
#include "sync/protocol.hpp"
#include "sync/publisher.hpp"
#include "sync/publisher_resume.hpp"
#include "sync/subscriber.hpp"
#include "test_support.hpp"

namespace {

using namespace deltasync;

// A small model: three bf16 matrices and an f32 vector.
struct Trainer {
  std::vector<TensorMeta> meta{{"layers.0.weight", DType::BF16, {48, 64}},
                               {"layers.1.weight", DType::BF16, {64, 40}},
                               {"embed", DType::BF16, {100, 16}},
                               {"norm", DType::F32, {64}}};
  std::vector<std::vector<uint8_t>> data;
  uint64_t rng = 12345;

  Trainer() {
    for (size_t t = 0; t < meta.size(); ++t) data.push_back(random_bytes(meta[t].numel() * meta[t].width(), 100 + t));
  }
  uint64_t next() {
    rng += 0x9E3779B97F4A7C15ull;
    uint64_t z = rng;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // About `per_mille`/1000 of the elements move by one unit in the last place.
  void step(unsigned per_mille = 10) {
    for (size_t t = 0; t < meta.size(); ++t) {
      const uint32_t w = meta[t].width();
      for (uint64_t i = 0; i < meta[t].numel(); ++i) {
        if (next() % 1000 >= per_mille) continue;
        uint8_t* p = data[t].data() + i * w;
        if (w == 2) {
          uint16_t v;
          std::memcpy(&v, p, 2);
          v = static_cast<uint16_t>(v + ((next() & 1) ? 1 : -1));
          std::memcpy(p, &v, 2);
        } else {
          uint32_t v;
          std::memcpy(&v, p, 4);
          v += (next() & 1) ? 1 : -1;
          std::memcpy(p, &v, 4);
        }
      }
    }
  }
  std::vector<ConstTensorRef> refs() const {
    std::vector<ConstTensorRef> out;
    for (size_t t = 0; t < meta.size(); ++t) out.push_back({meta[t].name, data[t].data(), meta[t].numel(), meta[t].width()});
    return out;
  }
};

void expect_identical(const HostModel& model, const Trainer& trainer, uint64_t version) {
  ASSERT_EQ(model.version, version);
  ASSERT_EQ(model.tensors.size(), trainer.meta.size());
  for (size_t t = 0; t < trainer.meta.size(); ++t) {
    EXPECT_EQ(model.tensors[t].name, trainer.meta[t].name);
    EXPECT_TRUE(model.data[t] == trainer.data[t]) << "tensor " << trainer.meta[t].name << " differs at version " << version;
  }
}

// The option table names each option once and reaches a distinct member: setting every field
// through the table changes every option, and names are unique (they become CLI flags and Python
// keywords).
TEST(PublisherOptions, TableReachesEveryOptionOnce) {
  PublisherOptions o;
  std::set<std::string> names;
  fields::for_each(publisher_option_fields(), [&](const auto& f) {
    EXPECT_TRUE(names.insert(std::string(f.name)).second) << f.name;
    using T = typename std::decay_t<decltype(f)>::value_type;
    if constexpr (std::is_same_v<T, std::string>) f.get(o) = "trl";
    else f.get(o) = static_cast<T>(f.get(o) + 7);
  });
  const PublisherOptions d;
  EXPECT_EQ(o.anchor_every, d.anchor_every + 7);
  EXPECT_EQ(o.anchor_share, d.anchor_share + 7);
  EXPECT_EQ(o.max_pending, d.max_pending + 7);
  EXPECT_EQ(o.anchor_part_bytes, d.anchor_part_bytes + 7);
  EXPECT_EQ(o.parallel_uploads, d.parallel_uploads + 7);
  EXPECT_EQ(o.keep_anchors, d.keep_anchors + 7);
  EXPECT_EQ(o.delta_format, "trl");
  EXPECT_EQ(o.compact_version, d.compact_version + 7);
}

TEST(PublisherOptions, RefusesOptionsNoPublisherCanWorkWith) {
  PublisherOptions o;
  o.anchor_part_bytes = 0;
  EXPECT_EQ(error_message([&] { check_options(o); }), "publisher: option anchor_part_bytes must be positive");
  o = {};
  o.parallel_uploads = 0;
  EXPECT_EQ(error_message([&] { check_options(o); }), "publisher: option parallel_uploads must be positive");
  o = {};
  o.anchor_share = -0.5;
  EXPECT_EQ(error_message([&] { check_options(o); }), "publisher: option anchor_share must be a non-negative number");
  o = {};
  o.compact_version = 3;
  EXPECT_EQ(error_message([&] { check_options(o); }), "publisher: option compact_version must be 1 or 2");
  EXPECT_NO_THROW(check_options(PublisherOptions{}));
}

TEST(MergeDeltas, UnionWithNewestValuesAndOldestBase) {
  Trainer trainer;
  std::vector<std::vector<uint8_t>> shadow = trainer.data;
  const auto original = trainer.data;
  auto encode = [&](SparseDelta& out) {
    std::vector<EncodeItem> items;
    for (size_t t = 0; t < trainer.meta.size(); ++t)
      items.push_back({trainer.meta[t].name, trainer.data[t].data(), shadow[t].data(), trainer.meta[t].numel(), trainer.meta[t].width()});
    cpu::encode(items, out);
  };
  SparseDelta first, second;
  trainer.step(50);
  encode(first);
  trainer.step(50);
  encode(second);
  SparseDelta merged = merge_deltas(first.view(), second.view(), trainer.meta);
  EXPECT_GE(merged.indices.size(), std::max(first.indices.size(), second.indices.size()));
  EXPECT_LE(merged.indices.size(), first.indices.size() + second.indices.size());
  // Applying the merged delta to the original weights gives the newest ones...
  auto weights = original;
  std::vector<TensorRef> targets;
  std::vector<PatchRef> patches;
  for (size_t t = 0; t < trainer.meta.size(); ++t) {
    targets.push_back({trainer.meta[t].name, weights[t].data(), trainer.meta[t].numel(), trainer.meta[t].width()});
    patches.push_back(merged.view().patch(t, trainer.meta[t].width()));
  }
  cpu::apply(targets, patches);
  EXPECT_EQ(weights, trainer.data);
  // ...and its base values are the original bits at the merged positions.
  for (size_t t = 0; t < trainer.meta.size(); ++t) {
    const uint32_t w = trainer.meta[t].width();
    for (uint64_t k = merged.offsets[t]; k < merged.offsets[t + 1]; ++k) {
      const uint64_t i = static_cast<uint64_t>(merged.indices[k]);
      ASSERT_EQ(std::memcmp(merged.base_values.data() + merged.value_offsets[t] + (k - merged.offsets[t]) * w,
                            original[t].data() + i * w, w), 0);
    }
  }
}

TEST(PublishSubscribe, FollowingLateAndCorruptedReadersEndIdentical) {
  TempDir dir;
  std::shared_ptr<Store> store = open_store(dir.path().string());
  Trainer trainer;
  PublisherOptions options;
  options.anchor_every = 8;
  options.anchor_share = 0;  // anchors by count only, so the test knows where they are
  options.keep_anchors = 0;
  Publisher publisher(store, trainer.meta, options);

  auto reader_store = open_store(dir.path().string());
  Subscriber follower(*reader_store);
  HostModel following;
  for (uint64_t v = 1; v <= 20; ++v) {
    if (v > 1) trainer.step();
    publisher.publish(v, trainer.refs());
    publisher.flush();
    auto report = follower.sync(following);
    ASSERT_EQ(report.to, v);
    EXPECT_FALSE(report.recovered);
    if (v > 1) {
      EXPECT_FALSE(report.plan.anchor_version) << "a following reader needs only the next delta (v" << v << ")";
      EXPECT_EQ(report.plan.deltas, (std::vector<uint64_t>{v}));
    }
    expect_identical(following, trainer, v);
  }
  auto stats = publisher.stats();
  ASSERT_EQ(stats.size(), 20u);
  EXPECT_TRUE(stats[0].anchor);
  EXPECT_TRUE(stats[8].anchor);   // v9: 8 versions after v1
  EXPECT_TRUE(stats[16].anchor);  // v17
  EXPECT_FALSE(stats[5].anchor);
  EXPECT_GT(stats[5].delta_bytes, 0u);
  EXPECT_LT(stats[5].delta_bytes, stats[0].anchor_bytes / 4);  // tiny model: headers weigh

  // A reader that joins late starts from the newest anchor.
  Subscriber late_sub(*reader_store);
  HostModel late;
  auto late_report = late_sub.sync(late);
  EXPECT_EQ(late_report.plan.anchor_version, 17u);
  expect_identical(late, trainer, 20);

  // A reader whose weights were corrupted (same version label, different bits) is detected by
  // its digests and rebuilt.
  trainer.step();
  publisher.publish(21, trainer.refs());
  publisher.flush();
  following.data[1][7] ^= 0x40;
  following.digests.clear();
  auto healed = follower.sync(following);
  EXPECT_TRUE(healed.recovered);
  EXPECT_NE(healed.recovery_reason.find("layers.1.weight"), std::string::npos) << healed.recovery_reason;
  expect_identical(following, trainer, 21);

  // A reader that missed versions catches up in one sync; a pinned version works too.
  Subscriber pinned_sub(*reader_store);
  HostModel pinned;
  pinned_sub.sync(pinned, 12);
  ASSERT_EQ(pinned.version, 12u);
  for (uint64_t v = 22; v <= 26; ++v) {
    trainer.step();
    publisher.publish(v, trainer.refs());
  }
  publisher.flush();
  auto jump = pinned_sub.sync(pinned);
  EXPECT_EQ(jump.from, 12u);
  expect_identical(pinned, trainer, 26);
}

TEST(PublishSubscribe, CorruptObjectInTheStoreFallsBackToAnAnchor) {
  TempDir dir;
  std::shared_ptr<Store> store = open_store(dir.path().string());
  Trainer trainer;
  PublisherOptions options;
  options.anchor_every = 5;
  options.anchor_share = 0;
  options.keep_anchors = 0;
  Publisher publisher(store, trainer.meta, options);
  Subscriber sub(*store);
  HostModel model;
  publisher.publish(1, trainer.refs());
  publisher.flush();
  sub.sync(model);
  for (uint64_t v = 2; v <= 8; ++v) {
    trainer.step();
    publisher.publish(v, trainer.refs());
    publisher.flush();  // one upload per version: anchors exactly where anchor_every puts them
  }
  // Damage delta 3 (bit rot or a bad copy): the reader at 1 must not apply it.
  protocol::Catalog catalog(*store);
  const std::string key = catalog.find(3)->delta->key;
  auto bytes = store->get(key);
  bytes[bytes.size() / 2] ^= 1;
  store->put(key, bytes);
  auto report = sub.sync(model);
  EXPECT_TRUE(report.recovered);
  EXPECT_NE(report.recovery_reason.find("sha256 differs"), std::string::npos) << report.recovery_reason;
  EXPECT_EQ(report.plan.anchor_version, 6u);
  expect_identical(model, trainer, 8);
}

// Wraps a store so that a test decides what the publisher's uploads meet: puts held at a
// gate until the test opens it (the publisher then falls behind, with no timing involved),
// injected put failures, and exclusive creates that succeed but whose answer is "lost".
class ControlledStore final : public Store {
 public:
  explicit ControlledStore(std::shared_ptr<Store> inner) : inner_(std::move(inner)) {}
  std::string url() const override { return inner_->url(); }
  void put(const std::string& k, std::span<const uint8_t> b) override {
    wait_at_gate();
    if (fail_next_ > 0 && (fail_only_key_.empty() || k == fail_only_key_)) {
      --fail_next_;
      throw Error(describe(k) + ": PUT failed after 5 attempts: HTTP 503 (injected)");
    }
    inner_->put(k, b);
  }
  bool put_if_absent(const std::string& k, std::span<const uint8_t> b) override {
    const bool created = inner_->put_if_absent(k, b);
    if (lose_create_answers_ > 0) {
      --lose_create_answers_;
      throw Error(describe(k) + ": PUT failed after 5 attempts: connection reset (injected after the object was stored)");
    }
    return created;
  }
  std::vector<uint8_t> get(const std::string& k) override { return inner_->get(k); }
  std::vector<uint8_t> get_range(const std::string& k, uint64_t o, uint64_t n) override { return inner_->get_range(k, o, n); }
  std::optional<ObjectInfo> head(const std::string& k) override { return inner_->head(k); }
  std::vector<ObjectInfo> list(const std::string& p) override { return inner_->list(p); }
  void remove(const std::string& k) override { inner_->remove(k); }

  void close_gate() {
    std::lock_guard<std::mutex> lock(gate_mutex_);
    gate_open_ = false;
  }
  void open_gate() {
    {
      std::lock_guard<std::mutex> lock(gate_mutex_);
      gate_open_ = true;
    }
    gate_changed_.notify_all();
  }
  // Returns once some put is waiting at the closed gate.
  void wait_until_held() {
    std::unique_lock<std::mutex> lock(gate_mutex_);
    gate_changed_.wait(lock, [&] { return held_ > 0; });
  }

  std::atomic<int> fail_next_{0};
  std::string fail_only_key_;  // fail only puts of this key (empty: any)
  std::atomic<int> lose_create_answers_{0};

 private:
  void wait_at_gate() {
    std::unique_lock<std::mutex> lock(gate_mutex_);
    ++held_;
    gate_changed_.notify_all();
    gate_changed_.wait(lock, [&] { return gate_open_; });
    --held_;
  }

  std::shared_ptr<Store> inner_;
  std::mutex gate_mutex_;
  std::condition_variable gate_changed_;
  bool gate_open_ = true;
  int held_ = 0;
};

TEST(PublishSubscribe, FallingBehindMergesPendingVersions) {
  TempDir dir;
  auto gated = std::make_shared<ControlledStore>(open_store(dir.path().string()));
  Trainer trainer;
  PublisherOptions options;
  options.anchor_every = 0;
  options.anchor_share = 0;
  options.max_pending = 1;
  Publisher publisher(gated, trainer.meta, options);
  // Version 1's upload is held inside the store while versions 2..12 are published.
  gated->close_gate();
  publisher.publish(1, trainer.refs());
  gated->wait_until_held();
  for (uint64_t v = 2; v <= 12; ++v) {
    trainer.step();
    publisher.publish(v, trainer.refs());  // never waits for the store
  }
  gated->open_gate();
  publisher.flush();
  auto stats = publisher.stats();
  ASSERT_EQ(stats.size(), 2u) << "versions 2..12 waited behind version 1 and were merged into one upload";
  EXPECT_EQ(stats[0].version, 1u);
  EXPECT_EQ(stats[1].version, 12u);
  EXPECT_EQ(stats[1].merged_versions, 11u);
  EXPECT_EQ(stats[1].base_version, 1u);
  EXPECT_FALSE(stats[1].anchor);
  auto reader_store = open_store(dir.path().string());
  Subscriber sub(*reader_store);
  HostModel model;
  sub.sync(model);
  expect_identical(model, trainer, 12);
  // The chain is intact: from the first version a reader walks only deltas.
  HostModel from_first;
  sub.sync(from_first, 1);
  auto r = sub.sync(from_first);
  EXPECT_FALSE(r.plan.anchor_version);
  expect_identical(from_first, trainer, 12);
}

TEST(PublishSubscribe, ManifestCreatedButItsAnswerLostIsFinishedOnTheNextTry) {
  TempDir dir;
  auto flaky = std::make_shared<ControlledStore>(open_store(dir.path().string()));
  Trainer trainer;
  PublisherOptions options;
  options.keep_anchors = 0;
  Publisher publisher(flaky, trainer.meta, options);
  publisher.publish(1, trainer.refs());
  publisher.flush();
  trainer.step();
  flaky->lose_create_answers_ = 1;
  publisher.publish(2, trainer.refs());
  EXPECT_NE(error_message([&] { publisher.flush(); }).find("injected"), std::string::npos);
  protocol::Catalog catalog(*flaky);
  ASSERT_TRUE(catalog.find(2)) << "the store kept the manifest whose answer was lost";
  // The next try recognizes its own manifest and finishes the version (it used to refuse it as
  // "already exists" on every try, so the publisher never moved again).
  publisher.flush();
  EXPECT_EQ(protocol::read_latest(*flaky), 2u);
  EXPECT_EQ(publisher.state().last_version, 2u);
  Subscriber sub(*flaky);
  HostModel model;
  sub.sync(model);
  expect_identical(model, trainer, 2);
  trainer.step();
  publisher.publish(3, trainer.refs());
  publisher.flush();
  auto report = sub.sync(model);
  EXPECT_EQ(report.plan.deltas, (std::vector<uint64_t>{3}));
  expect_identical(model, trainer, 3);
}

TEST(PublishSubscribe, FailedUploadIsReportedThenRetried) {
  TempDir dir;
  auto flaky = std::make_shared<ControlledStore>(open_store(dir.path().string()));
  Trainer trainer;
  PublisherOptions options;
  options.keep_anchors = 0;
  Publisher publisher(flaky, trainer.meta, options);
  publisher.publish(1, trainer.refs());
  publisher.flush();
  trainer.step();
  flaky->fail_next_ = 1;
  publisher.publish(2, trainer.refs());
  std::string msg = error_message([&] { publisher.flush(); });
  EXPECT_NE(msg.find("HTTP 503"), std::string::npos) << msg;
  protocol::Catalog catalog(*flaky);
  EXPECT_FALSE(catalog.find(2)) << "a failed upload must not leave a visible version";
  publisher.flush();  // retried
  EXPECT_TRUE(catalog.find(2));
  trainer.step();
  publisher.publish(3, trainer.refs());
  publisher.flush();
  Subscriber sub(*flaky);
  HostModel model;
  sub.sync(model);
  expect_identical(model, trainer, 3);

  // A failure after the manifest is written (LATEST): the retry must not upload the version
  // again, only finish it.
  trainer.step();
  flaky->fail_only_key_ = protocol::kLatestKey;
  flaky->fail_next_ = 1;
  publisher.publish(4, trainer.refs());
  EXPECT_NE(error_message([&] { publisher.flush(); }).find("LATEST"), std::string::npos);
  EXPECT_TRUE(catalog.find(4)) << "the manifest was written before LATEST failed";
  EXPECT_EQ(protocol::read_latest(*flaky), 3u);
  const size_t deltas_before = flaky->list("deltas/").size();
  publisher.flush();
  EXPECT_EQ(protocol::read_latest(*flaky), 4u);
  EXPECT_EQ(flaky->list("deltas/").size(), deltas_before);
  sub.sync(model);
  expect_identical(model, trainer, 4);
  EXPECT_EQ(publisher.state().last_version, 4u);
  EXPECT_NE(error_message([&] { publisher.publish(3, trainer.refs()); }).find("not newer"), std::string::npos);
}

TEST(PublishSubscribe, RetentionKeepsReadersWorking) {
  TempDir dir;
  std::shared_ptr<Store> store = open_store(dir.path().string());
  Trainer trainer;
  PublisherOptions options;
  options.anchor_every = 4;
  options.anchor_share = 0;
  options.keep_anchors = 2;
  Publisher publisher(store, trainer.meta, options);
  for (uint64_t v = 1; v <= 14; ++v) {
    if (v > 1) trainer.step();
    publisher.publish(v, trainer.refs());
    publisher.flush();
  }
  protocol::Catalog catalog(*store);
  auto versions = catalog.refresh();
  EXPECT_EQ(versions.front(), 9u);  // anchors at 1, 5, 9, 13: keep 9 and 13
  EXPECT_EQ(versions.back(), 14u);
  Subscriber sub(*store);
  HostModel model;
  sub.sync(model);
  expect_identical(model, trainer, 14);
}

// A publisher restarted with nothing but the store (the soak kills it mid-publish): it continues
// the store's newest version, as a delta from it, with the anchor schedule it had.
TEST(PublisherResume, AnEmptyStoreHasNothingToResume) {
  TempDir dir;
  auto store = open_store(dir.path().string());
  EXPECT_FALSE(resume_from_store(*store).has_value());
}

TEST(PublisherResume, ContinuesTheNewestManifestEvenWhenLatestLagsBehindIt) {
  TempDir dir;
  std::shared_ptr<Store> store = open_store(dir.path().string());
  Trainer trainer;
  PublisherOptions options;
  options.anchor_every = 4;
  options.keep_anchors = 0;
  uint64_t delta_bytes_5_6 = 0;
  {
    Publisher publisher(store, trainer.meta, options);
    for (uint64_t v = 0; v <= 6; ++v) {
      if (v) trainer.step();
      publisher.publish(v, trainer.refs());
      publisher.flush();
    }
    for (const auto& s : publisher.stats())
      if (s.version == 5 || s.version == 6) delta_bytes_5_6 += s.delta_bytes;
  }
  // Killed between version 6's manifest and LATEST: the version is visible, LATEST still says 5.
  const std::string five = "5\n";
  store->put(protocol::kLatestKey, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(five.data()), five.size()));

  std::optional<StoreResume> resumed = resume_from_store(*store);
  ASSERT_TRUE(resumed.has_value());
  EXPECT_EQ(resumed->state.last_version, 6u);
  EXPECT_EQ(resumed->state.last_anchor_version, 4u);
  EXPECT_EQ(resumed->state.delta_bytes_since_anchor, delta_bytes_5_6);
  expect_identical(resumed->shadow, trainer, 6);

  Publisher publisher(store, trainer.meta, options);
  publisher.restore(resumed->shadow, resumed->state);
  trainer.step();
  publisher.publish(7, trainer.refs());
  publisher.flush();
  trainer.step();
  publisher.publish(8, trainer.refs());
  publisher.flush();
  protocol::Catalog catalog(*store);
  ASSERT_TRUE(catalog.find(7));
  EXPECT_FALSE(catalog.find(7)->has_anchor()) << "a resumed publisher goes on with deltas, not a fresh anchor";
  EXPECT_EQ(catalog.find(7)->base_version, 6u);
  EXPECT_TRUE(catalog.find(8)->has_anchor()) << "the anchor schedule continues from version 4";
  EXPECT_EQ(protocol::read_latest(*store), 8u);
  Subscriber sub(*store);
  HostModel model;
  sub.sync(model, 6);
  const auto report = sub.sync(model, 8);
  EXPECT_EQ(report.deltas, (std::vector<uint64_t>{7, 8}));
  expect_identical(model, trainer, 8);
}

}  // namespace
