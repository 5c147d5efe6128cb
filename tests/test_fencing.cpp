// Fencing on the folder store: a run claims a store with a new epoch; another run is refused and
// writes nothing; a restart of the same run takes a new epoch and resumes from the store; the old
// epoch's publisher, still alive, is refused and nothing it writes becomes visible, even a manifest
// for a version the new epoch has not used; a store from before fencing stays readable; the folder
// store's compare-and-swap loses no update between concurrent writers.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <set>
#include <string>
#include <thread>

#include "sync/protocol.hpp"
#include "sync/publisher.hpp"
#include "sync/publisher_resume.hpp"
#include "sync/subscriber.hpp"
#include "test_support.hpp"

namespace {

using namespace deltasync;
using namespace deltasync::protocol;

std::span<const uint8_t> bytes_of(const std::string& s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

std::string text_of(const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); }

// Every file under the store's folder (hidden ones included), with its bytes.
std::map<std::string, std::string> snapshot(const std::filesystem::path& root) {
  std::map<std::string, std::string> out;
  if (!std::filesystem::exists(root)) return out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root))
    if (e.is_regular_file()) out[std::filesystem::relative(e.path(), root).string()] = text_of(read_file_bytes(e.path().string()));
  return out;
}

// A tiny model whose weights move every step.
struct Model {
  std::vector<TensorMeta> meta{{"w", DType::BF16, {32, 16}}, {"b", DType::F32, {16}}};
  std::vector<std::vector<uint8_t>> data{random_bytes(32 * 16 * 2, 1), random_bytes(16 * 4, 2)};
  uint64_t steps = 0;
  void step() {
    ++steps;
    for (auto& d : data)
      for (size_t i = steps % 7; i < d.size(); i += 41) d[i] = static_cast<uint8_t>(d[i] + 1);
  }
  std::vector<ConstTensorRef> refs() const {
    std::vector<ConstTensorRef> out;
    for (size_t t = 0; t < meta.size(); ++t) out.push_back({meta[t].name, data[t].data(), meta[t].numel(), meta[t].width()});
    return out;
  }
};

PublisherOptions run(const std::string& id, bool take_over = false) {
  PublisherOptions o;
  o.run_id = id;
  o.take_over = take_over;
  o.anchor_every = 3;
  o.keep_anchors = 0;
  return o;
}

void expect_weights(const HostModel& got, const Model& want, uint64_t version) {
  ASSERT_EQ(got.version, version);
  ASSERT_EQ(got.data.size(), want.data.size());
  for (size_t t = 0; t < want.data.size(); ++t) EXPECT_TRUE(got.data[t] == want.data[t]) << want.meta[t].name << " at " << version;
}

TEST(Fencing, LatestPointerRoundTripsAndOldPointersStayReadable) {
  const LatestPointer p{12, Fence{"run-a", 3, 9}};
  EXPECT_EQ(latest_text(p), "12\nrun run-a\nepoch 3\nsince 9\n");
  const LatestPointer back = parse_latest_pointer(latest_text(p), "b/LATEST");
  EXPECT_EQ(back.version, 12u);
  EXPECT_EQ(back.fence, p.fence);
  const LatestPointer claimed = parse_latest_pointer(latest_text(LatestPointer{std::nullopt, Fence{"r", 1, std::nullopt}}), "b/LATEST");
  EXPECT_FALSE(claimed.version);
  EXPECT_EQ(claimed.fence->since, std::nullopt);
  const LatestPointer old = parse_latest_pointer("7\n", "b/LATEST");
  EXPECT_EQ(old.version, 7u);
  EXPECT_FALSE(old.fence);
  EXPECT_EQ(error_message([] { parse_latest_pointer("7\nrun a\nepoc 1\nsince 3\n", "b/LATEST"); }),
            "b/LATEST: LATEST pointer line 3 is not 'epoch ...'");
  EXPECT_EQ(error_message([] { parse_latest_pointer("7\nrun a\nepoch -1\nsince 3\n", "b/LATEST"); }),
            "b/LATEST: LATEST epoch '-1': not a decimal integer");
}

TEST(Fencing, ManifestRecordsItsFenceAndOldManifestsHaveNone) {
  Manifest m;
  m.version = 4;
  m.anchor_parts.push_back(ObjectRef{"anchors/x/part-00000.safetensors", 10, std::string(64, 'a')});
  m.latest_anchor = 4;
  m.fence = Fence{"run-a", 2, 3};
  const Manifest back = manifest_from_json(to_json(m), "m");
  EXPECT_EQ(back.fence, m.fence);
  m.fence.reset();
  EXPECT_EQ(to_json(m).find("fence"), std::string::npos) << "a manifest without a fence is written as before";
  EXPECT_FALSE(manifest_from_json(to_json(m), "m").fence);
}

TEST(Fencing, AnotherRunIsRefusedAndWritesNothing) {
  TempDir dir;
  auto store = std::shared_ptr<Store>(open_folder_store(dir.file("store")));
  Model model;
  {
    Publisher a(store, model.meta, run("run-a"));
    EXPECT_EQ(a.fence(), (Fence{"run-a", 1, std::nullopt}));
    for (uint64_t v = 1; v <= 3; ++v) {
      model.step();
      a.publish(v, model.refs());
    }
    a.flush();
  }
  const auto before = snapshot(dir.path() / "store");
  const std::string message = error_message([&] { Publisher b(store, model.meta, run("run-b")); });
  EXPECT_EQ(message, "file://" + dir.file("store") + ": the store is published by run run-a (epoch 1); refusing to publish run "
                     "run-b into it (taking it over is explicit: --take-over, or take_over=True)");
  EXPECT_EQ(message.find('\n'), std::string::npos);
  EXPECT_EQ(snapshot(dir.path() / "store"), before) << "a refused run writes nothing";
  EXPECT_EQ(claim_store(*store, "run-a", false).epoch, 2u) << "the store's own run is not refused";
}

TEST(Fencing, TakeOverIsExplicitAndTakesANewEpoch) {
  TempDir dir;
  auto store = std::shared_ptr<Store>(open_folder_store(dir.file("store")));
  Model model;
  {
    Publisher a(store, model.meta, run("run-a"));
    model.step();
    a.publish(1, model.refs());
    a.flush();
  }
  Publisher b(store, model.meta, run("run-b", /*take_over=*/true));
  EXPECT_EQ(b.fence(), (Fence{"run-b", 2, 1}));
  auto resumed = resume_from_store(*store);
  ASSERT_TRUE(resumed);
  b.restore(resumed->shadow, resumed->state);
  model.step();
  b.publish(2, model.refs());
  b.flush();
  EXPECT_EQ(read_latest_pointer(*store)->fence, (Fence{"run-b", 2, 1}));
  Catalog catalog(*store);
  ASSERT_TRUE(catalog.find(2));
  EXPECT_EQ(catalog.find(2)->fence, (Fence{"run-b", 2, 1}));
  EXPECT_EQ(catalog.find(2)->base_version, 1u) << "the new run continues the store's chain";
}

// A restart of the same run takes a new epoch and resumes from the store; the old epoch's
// publisher, still alive (only partitioned), is refused from then on, and what it manages to write
// anyway (a manifest for a version the new epoch has not used) is invisible to every reader.
TEST(Fencing, RestartFencesOffTheOldEpoch) {
  TempDir dir;
  auto store = std::shared_ptr<Store>(open_folder_store(dir.file("store")));
  Model model;
  Publisher zombie(store, model.meta, run("run-a"));
  for (uint64_t v = 1; v <= 4; ++v) {
    model.step();
    zombie.publish(v, model.refs());
    zombie.flush();  // each version on its own (a publisher that falls behind merges them)
  }
  const Model at4 = model;

  Publisher restarted(store, model.meta, run("run-a"));
  EXPECT_EQ(restarted.fence(), (Fence{"run-a", 2, 4}));
  auto resumed = resume_from_store(*store);
  ASSERT_TRUE(resumed);
  expect_weights(resumed->shadow, at4, 4);
  restarted.restore(resumed->shadow, resumed->state);
  model.step();
  restarted.publish(5, model.refs());
  restarted.flush();
  const Model at5 = model;

  // The zombie publishes 7: refused before it uploads anything.
  Model diverged = at4;
  diverged.step();
  diverged.step();
  const std::string refused = error_message([&] {
    zombie.publish(7, diverged.refs());  // reports the failure itself when the upload failed already
    zombie.flush();
  });
  EXPECT_NE(refused.find("run run-a (epoch 1) was fenced off: the store is now run run-a (epoch 2)"), std::string::npos) << refused;
  EXPECT_FALSE(store->head(manifest_key(7)));
  for (const auto& info : store->list("deltas/")) EXPECT_EQ(info.key.find(std::string(20 - 1, '0') + "7-"), std::string::npos) << info.key;

  // A zombie that got past the check just before the takeover: its manifest for version 6
  // lands, its LATEST is refused.
  Catalog writer(*store);
  ASSERT_TRUE(writer.find(4));
  Manifest late = *writer.find(4);
  late.version = 6;
  late.base_version = 4;
  late.delta = ObjectRef{"deltas/zombie.safetensors", 3, std::string(64, '0')};
  late.delta_format = "compact";
  late.anchor_parts.clear();
  late.latest_anchor = writer.find(4)->latest_anchor;
  late.fence = zombie.fence();
  ASSERT_TRUE(write_manifest(*store, late));
  EXPECT_THROW(advance_latest(*store, 6, zombie.fence()), FencedError);
  EXPECT_THROW(commit_version(*store, late), FencedError);

  // No reader sees version 6: not the catalog, not a subscriber, not a publisher resuming.
  Catalog catalog(*store);
  EXPECT_EQ(catalog.refresh(), (std::vector<uint64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(catalog.newest(true), 5u);
  EXPECT_EQ(catalog.find(6), nullptr);
  EXPECT_FALSE(plan_catch_up(catalog, 4, 6));
  Subscriber sub(*store);
  EXPECT_EQ(sub.poll(), 5u);
  HostModel follower;
  sub.sync(follower);
  expect_weights(follower, at5, 5);
  auto again = resume_from_store(*store);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->state.last_version, 5u);

  // The restarted epoch goes on past the zombie's number.
  model.step();
  restarted.publish(8, model.refs());
  restarted.flush();
  EXPECT_EQ(sub.poll(), 8u);
  sub.sync(follower);
  expect_weights(follower, model, 8);

  // Retention removes the superseded manifest with the versions before the oldest kept anchor.
  model.step();
  restarted.publish(9, model.refs(), /*force_anchor=*/true);
  restarted.flush();
  const RetentionReport kept = apply_retention(*store, 1);
  EXPECT_EQ(kept.deleted_versions, (std::vector<uint64_t>{1, 2, 3, 4, 5, 6, 8}));
  EXPECT_FALSE(store->head(manifest_key(6)));
}

// A store from before fencing: LATEST "V\n", manifests without a fence. Readers read it as ever;
// the first fenced publisher claims it as epoch 1 without taking it over, and from then on its
// manifests count as epoch 0 (all older than the claim's `since`, so all still visible).
TEST(Fencing, AStoreFromBeforeFencingIsClaimedWithoutTakeOver) {
  TempDir dir;
  auto store = std::shared_ptr<Store>(open_folder_store(dir.file("store")));
  Model model;
  {
    Publisher a(store, model.meta, run("run-a"));
    for (uint64_t v = 1; v <= 3; ++v) {
      model.step();
      a.publish(v, model.refs());
      a.flush();  // each version on its own
    }
  }
  // Rewrite it as an old publisher would have: no fence anywhere.
  Catalog old_catalog(*store);
  for (uint64_t v = 1; v <= 3; ++v) {
    const Manifest* found = old_catalog.find(v);
    ASSERT_TRUE(found) << v;
    Manifest m = *found;
    m.fence.reset();
    store->put(manifest_key(v), bytes_of(to_json(m)));
  }
  store->put(kLatestKey, bytes_of("3\n"));
  Subscriber reader(*store);
  HostModel follower;
  reader.sync(follower);
  expect_weights(follower, model, 3);

  Publisher b(store, model.meta, run("run-b"));
  EXPECT_EQ(b.fence(), (Fence{"run-b", 1, 3}));
  EXPECT_EQ(Catalog(*store).refresh(), (std::vector<uint64_t>{1, 2, 3}));
}

// Two runs start on one empty store at once: exactly one claims it.
TEST(Fencing, RacingClaimsOfAnEmptyStoreHaveOneWinner) {
  for (int round = 0; round < 5; ++round) {
    TempDir dir;
    auto store = std::shared_ptr<Store>(open_folder_store(dir.file("store")));
    std::atomic<int> won{0}, refused{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < 4; ++i)
      threads.emplace_back([&, i] {
        try {
          claim_store(*store, "run-" + std::to_string(i), false);
          ++won;
        } catch (const FencedError&) {
          ++refused;
        }
      });
    for (auto& t : threads) t.join();
    EXPECT_EQ(won.load(), 1);
    EXPECT_EQ(refused.load(), 3);
    EXPECT_EQ(read_latest_pointer(*store)->fence->epoch, 1u);
  }
}

// The folder store's put_if_match: a stale tag is refused, and concurrent read-modify-write loops
// lose no update.
TEST(Fencing, FolderCompareAndSwapLosesNoUpdate) {
  TempDir dir;
  auto store = open_folder_store(dir.file("store"));
  ASSERT_TRUE(store->supports_put_if_match());
  store->put("counter", bytes_of("0"));
  const std::string tag = store->head("counter")->etag;
  EXPECT_TRUE(store->put_if_match("counter", bytes_of("0"), tag));
  EXPECT_FALSE(store->put_if_match("counter", bytes_of("1"), tag)) << "the tag moved with the first swap";
  EXPECT_FALSE(store->put_if_match("absent", bytes_of("1"), tag));
  EXPECT_FALSE(store->head("absent"));
  constexpr int kThreads = 4, kEach = 50;
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&] {
      auto own = open_folder_store(dir.file("store"));  // a writer of its own, as another process would be
      for (int n = 0; n < kEach;) {
        const auto r = own->get_if_changed("counter", "");
        const int value = std::stoi(text_of(r.bytes));
        if (own->put_if_match("counter", bytes_of(std::to_string(value + 1)), r.etag)) ++n;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(text_of(store->get("counter")), std::to_string(kThreads * kEach));
  for (const auto& info : store->list("")) EXPECT_EQ(info.key, "counter") << "no lock or temporary file is listed";
}

}  // namespace
