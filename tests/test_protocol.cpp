// Manifests (strict JSON), exclusive commit and LATEST, catch-up planning by bytes, retention.
#include <gtest/gtest.h>

#include <string>

#include "sync/protocol.hpp"
#include "format/sha256.hpp"
#include "test_support.hpp"

namespace {

using namespace deltasync;
using namespace deltasync::protocol;

std::span<const uint8_t> bytes_of(const std::string& s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

// Puts an object of `size` bytes and returns its reference.
ObjectRef put_object(Store& store, const std::string& key, size_t size) {
  std::string payload(size, 'x');
  store.put(key, bytes_of(payload));
  return ObjectRef{key, size, sha256_hex(bytes_of(payload))};
}

// A synthetic version: a delta of `delta_size` bytes from `base` and/or an anchor.
Manifest make_version(Store& store, uint64_t v, std::optional<uint64_t> base, size_t delta_size, size_t anchor_size,
                      std::optional<uint64_t> latest_anchor) {
  Manifest m;
  m.version = v;
  const std::string nonce = new_nonce();
  if (base) {
    m.base_version = base;
    m.delta = put_object(store, delta_key(v, nonce), delta_size);
    m.delta_format = "compact";
  }
  if (anchor_size) {
    m.anchor_parts.push_back(put_object(store, anchor_part_key(v, nonce, 0), anchor_size / 2));
    m.anchor_parts.push_back(put_object(store, anchor_part_key(v, nonce, 1), anchor_size - anchor_size / 2));
    latest_anchor = v;
  }
  m.latest_anchor = latest_anchor;
  m.total_elements = 1000;
  m.model_bytes = 2000;
  m.digests = {{"w", "0123456789abcdef"}};
  EXPECT_TRUE(commit_version(store, m));
  return m;
}

TEST(Protocol, KeysSortByVersionAndParseBack) {
  EXPECT_LT(manifest_key(9), manifest_key(10));
  EXPECT_LT(manifest_key(99999), manifest_key(100000));
  EXPECT_EQ(version_of_manifest_key(manifest_key(12345)), 12345u);
  EXPECT_FALSE(version_of_manifest_key("manifests/12.json"));
  EXPECT_FALSE(version_of_manifest_key("manifests/0000000000000000001x.json"));
  EXPECT_FALSE(version_of_manifest_key("deltas/00000000000000000001.json"));
  EXPECT_NE(delta_key(3, "aaa"), delta_key(3, "bbb"));
}

TEST(Protocol, ManifestRoundTrip) {
  Manifest m;
  m.version = 7;
  m.base_version = 6;
  m.delta = ObjectRef{"deltas/x.safetensors", 123, std::string(64, 'a')};
  m.delta_format = "compact";
  m.changed_elements = 11;
  m.anchor_parts = {ObjectRef{"anchors/x/part-00000.safetensors", 999, std::string(64, 'b')}};
  m.latest_anchor = 7;
  m.total_elements = 5000;
  m.model_bytes = 10000;
  m.digest_algorithm = "sum-mix64-v1";
  m.digests = {{"a", "0000000000000001"}, {"b", "ffffffffffffffff"}};
  m.created_unix_ms = 1700000000123;
  Manifest back = manifest_from_json(to_json(m), "m");
  EXPECT_EQ(back.version, 7u);
  EXPECT_EQ(back.base_version, 6u);
  ASSERT_TRUE(back.delta);
  EXPECT_EQ(back.delta->key, m.delta->key);
  EXPECT_EQ(back.delta->size, 123u);
  EXPECT_EQ(back.anchor_parts.size(), 1u);
  EXPECT_EQ(back.anchor_bytes(), 999u);
  EXPECT_EQ(back.kind(), "anchor+delta");
  EXPECT_EQ(back.digests, m.digests);
  EXPECT_EQ(back.created_unix_ms, m.created_unix_ms);
  EXPECT_EQ(to_json(back), to_json(m));
}

TEST(Protocol, VerifyObjectChecksSizeAndHash) {
  const std::string payload = "some object bytes";
  const ObjectRef ref{"deltas/x.safetensors", payload.size(), sha256_hex(bytes_of(payload))};
  EXPECT_NO_THROW(verify_object(ref, bytes_of(payload), "obj"));
  EXPECT_THROW(verify_object(ref, bytes_of(payload + "!"), "obj"), Error);  // size differs
  std::string flipped = payload;
  flipped[0] ^= 1;
  try {
    verify_object(ref, bytes_of(flipped), "obj");
    FAIL() << "a changed byte must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("obj: sha256 differs"), std::string::npos) << e.what();
  }
}

TEST(Protocol, ManifestParsingIsStrict) {
  Manifest m;
  m.version = 3;
  m.base_version = 2;
  m.delta = ObjectRef{"deltas/x", 1, std::string(64, 'a')};
  m.delta_format = "compact";
  m.latest_anchor = 1;
  const std::string good = to_json(m);
  EXPECT_NO_THROW(manifest_from_json(good, "m"));
  auto broken = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    auto at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    return error_message([&] { manifest_from_json(text, "LABEL"); });
  };
  EXPECT_NE(broken("\"version\": 3", "\"version\": -3").find("LABEL: "), std::string::npos);
  EXPECT_NE(broken("\"base_version\": 2", "\"base_version\": 3").find("not older"), std::string::npos);
  EXPECT_NE(broken(std::string(64, 'a'), std::string(63, 'a') + "Z").find("sha256"), std::string::npos);
  EXPECT_NE(broken("\"deltas/x\"", "\"../etc/passwd\"").find("invalid object key"), std::string::npos);
  EXPECT_NE(broken("\"compact\"", "\"zip\"").find("delta_format"), std::string::npos);
  EXPECT_NE(broken("\"format_version\": 1", "\"format_version\": 4").find("not supported"), std::string::npos);
  EXPECT_NE(error_message([] { manifest_from_json("{", "LABEL"); }).find("not valid JSON"), std::string::npos);
  EXPECT_NE(error_message([] { manifest_from_json("{}", "LABEL"); }).find("format"), std::string::npos);
}

TEST(Protocol, CommitIsExclusiveAndLatestOnlyMovesForward) {
  TempDir dir;
  auto store = open_store(dir.path().string());
  EXPECT_FALSE(read_latest(*store));
  Manifest m = make_version(*store, 5, std::nullopt, 0, 100, std::nullopt);
  EXPECT_EQ(read_latest(*store), 5u);
  EXPECT_TRUE(commit_version(*store, m));  // a retry of the same commit (lost answer) is not a conflict
  Manifest other = m;
  other.created_unix_ms += 1;
  EXPECT_FALSE(commit_version(*store, other));  // but a different manifest never replaces it
  make_version(*store, 3, std::nullopt, 0, 100, std::nullopt);
  EXPECT_EQ(read_latest(*store), 5u);
  store->put(kLatestKey, bytes_of("garbage"));
  EXPECT_NE(error_message([&] { read_latest(*store); }).find("LATEST pointer 'garbage': not a decimal integer"), std::string::npos);
}

// v1 anchor; v2..v12 deltas (each from the previous); v6 anchor+delta.
struct Chain {
  TempDir dir;
  std::unique_ptr<Store> store = open_store(dir.path().string());
  explicit Chain(size_t delta_size) {
    make_version(*store, 1, std::nullopt, 0, 1000, std::nullopt);
    for (uint64_t v = 2; v <= 12; ++v) make_version(*store, v, v - 1, delta_size, v == 6 ? 1000 : 0, v >= 6 ? 6 : 1);
  }
};

TEST(Protocol, PlanFollowsTheChainWhenCheaper) {
  Chain chain(50);
  Catalog catalog(*chain.store);
  auto next = plan_catch_up(catalog, 11, 12);
  ASSERT_TRUE(next);
  EXPECT_FALSE(next->anchor_version);
  EXPECT_EQ(next->deltas, (std::vector<uint64_t>{12}));
  EXPECT_EQ(next->bytes, 50u);
  auto several = plan_catch_up(catalog, 2, 12);
  ASSERT_TRUE(several);
  EXPECT_FALSE(several->anchor_version);
  EXPECT_EQ(several->deltas.size(), 10u);
  EXPECT_EQ(several->bytes, 500u);
  auto same = plan_catch_up(catalog, 12, 12);
  ASSERT_TRUE(same);
  EXPECT_TRUE(same->deltas.empty());
  EXPECT_EQ(same->bytes, 0u);
}

TEST(Protocol, PlanTakesTheNewestAnchorWhenTheChainCostsMore) {
  Chain chain(300);
  Catalog catalog(*chain.store);
  // From v2: ten deltas (3000 B) versus anchor 6 + six deltas (1000 + 1800 B).
  auto plan = plan_catch_up(catalog, 2, 12);
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan->anchor_version, 6u);
  EXPECT_EQ(plan->deltas, (std::vector<uint64_t>{7, 8, 9, 10, 11, 12}));
  EXPECT_EQ(plan->bytes, 2800u);
  // A reader with nothing, and a recovery, start from an anchor too.
  auto fresh = plan_catch_up(catalog, std::nullopt, 12);
  ASSERT_TRUE(fresh);
  EXPECT_EQ(fresh->anchor_version, 6u);
  auto recovery = plan_catch_up(catalog, 11, 12, /*allow_current=*/false);
  ASSERT_TRUE(recovery);
  EXPECT_EQ(recovery->anchor_version, 6u);
  // Exactly at an anchor: the anchor alone.
  auto at_anchor = plan_catch_up(catalog, std::nullopt, 6);
  ASSERT_TRUE(at_anchor);
  EXPECT_EQ(at_anchor->anchor_version, 6u);
  EXPECT_TRUE(at_anchor->deltas.empty());
}

TEST(Protocol, PlanAroundAVersionTheChainSkips) {
  Chain chain(50);
  // v14 was merged from 13 and 14 by a publisher that fell behind: its base is 12, and a reader
  // at 13 (published elsewhere) cannot use it.
  make_version(*chain.store, 13, 12, 50, 0, 6);
  make_version(*chain.store, 14, 12, 60, 0, 6);
  Catalog catalog(*chain.store);
  auto plan = plan_catch_up(catalog, 13, 14);
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan->anchor_version, 6u);
  EXPECT_EQ(plan->deltas, (std::vector<uint64_t>{7, 8, 9, 10, 11, 12, 14}));
}

TEST(Protocol, NoPlanWithoutAnAnchor) {
  TempDir dir;
  auto store = open_store(dir.path().string());
  make_version(*store, 2, 1, 10, 0, std::nullopt);  // its base and anchor were never published
  Catalog catalog(*store);
  EXPECT_FALSE(plan_catch_up(catalog, std::nullopt, 2));
  EXPECT_TRUE(plan_catch_up(catalog, 1, 2));
}

TEST(Protocol, RetentionKeepsTheNewestAnchorsAndWhatFollows) {
  Chain chain(50);
  make_version(*chain.store, 13, 12, 50, 1000, 6);  // anchors now at 1, 6, 13
  // An orphan of a killed upload below the cut, and one above it.
  put_object(*chain.store, delta_key(3, "deadbeef0000"), 10);
  put_object(*chain.store, delta_key(14, "deadbeef0000"), 10);
  auto report = apply_retention(*chain.store, 2);
  EXPECT_EQ(report.deleted_versions, (std::vector<uint64_t>{1, 2, 3, 4, 5}));
  Catalog catalog(*chain.store);
  auto left = catalog.refresh();
  EXPECT_EQ(left.front(), 6u);
  EXPECT_EQ(left.back(), 13u);
  for (const auto& info : chain.store->list("deltas/")) {
    auto v = std::stoull(info.key.substr(7, 20));
    EXPECT_GE(v, 6u) << info.key;
  }
  EXPECT_TRUE(chain.store->head(delta_key(14, "deadbeef0000")));
  // Every remaining version's objects are all there, and the newest is reachable.
  for (uint64_t v : left) {
    const Manifest* m = catalog.find(v);
    if (m->delta) EXPECT_TRUE(chain.store->head(m->delta->key)) << v;
    for (const auto& p : m->anchor_parts) EXPECT_TRUE(chain.store->head(p.key)) << v;
  }
  EXPECT_TRUE(plan_catch_up(catalog, std::nullopt, 13));
  // Nothing more to delete with the same setting; 0 keeps everything.
  EXPECT_TRUE(apply_retention(*chain.store, 2).deleted_versions.empty());
  EXPECT_TRUE(apply_retention(*chain.store, 0).deleted_versions.empty());
}

}  // namespace
