// Integrity metadata and the transactional verified apply: a wrong base is refused with the
// exact message and nothing written, a wrong result is rolled back bit for bit, digest metadata
// round-trips (in memory and through a delta file) and malformed metadata is rejected.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "engine/cpu_engine.hpp"
#include "format/delta_file.hpp"
#include "codec/digest.hpp"
#include "core/error.hpp"
#include "engine/integrity.hpp"
#include "format/safetensors.hpp"
#include "core/sparse_delta.hpp"

namespace ds = deltasync;
namespace in = deltasync::integrity;

namespace {

// Expects `fn` to throw deltasync::Error with exactly `message`.
template <typename Fn>
void expect_error(Fn&& fn, const std::string& message) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected: " << message;
  } catch (const ds::Error& e) {
    EXPECT_EQ(std::string(e.what()), message);
  }
}

template <typename Fn>
void expect_error_containing(Fn&& fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one containing: " << part;
  } catch (const ds::Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// A small bf16 "model" of three tensors, a copy of it one optimizer step later, and the delta
// between them as cpu::encode produces it (with base values).
struct Fixture {
  std::vector<ds::TensorMeta> metas = {{"embed", ds::DType::BF16, {64, 32}},
                                       {"norm", ds::DType::BF16, {32}},
                                       {"mlp", ds::DType::F32, {48, 16}}};
  std::vector<std::vector<uint8_t>> base, next;
  ds::SparseDelta delta;

  explicit Fixture(uint64_t seed = 1) {
    std::mt19937_64 rng(seed);
    for (const auto& m : metas) {
      std::vector<uint8_t> b(m.numel() * m.width());
      for (auto& x : b) x = static_cast<uint8_t>(rng());
      auto n = b;
      // Change ~5% of the elements of every tensor but "norm" (left unchanged).
      if (m.name != "norm")
        for (uint64_t i = 0; i < m.numel(); ++i)
          if (rng() % 20 == 0) n[i * m.width()] ^= static_cast<uint8_t>(1 + rng() % 255);
      base.push_back(std::move(b));
      next.push_back(std::move(n));
    }
    auto shadow = base;
    std::vector<ds::EncodeItem> items;
    for (size_t t = 0; t < metas.size(); ++t)
      items.push_back({metas[t].name, next[t].data(), shadow[t].data(), metas[t].numel(), metas[t].width()});
    ds::cpu::encode(items, delta);
  }

  std::vector<ds::ConstTensorRef> refs(const std::vector<std::vector<uint8_t>>& data) const {
    std::vector<ds::ConstTensorRef> out;
    for (size_t t = 0; t < metas.size(); ++t) out.push_back({metas[t].name, data[t].data(), metas[t].numel(), metas[t].width()});
    return out;
  }
  std::vector<ds::TensorRef> targets(std::vector<std::vector<uint8_t>>& data) const {
    std::vector<ds::TensorRef> out;
    for (size_t t = 0; t < metas.size(); ++t) out.push_back({metas[t].name, data[t].data(), metas[t].numel(), metas[t].width()});
    return out;
  }
  std::vector<ds::PatchRef> patches() const {
    std::vector<ds::PatchRef> out;
    for (size_t t = 0; t < metas.size(); ++t) out.push_back(delta.view().patch(t, metas[t].width()));
    return out;
  }
  in::DeltaDigests digests(uint64_t model_version = 8, std::optional<uint64_t> base_version = 7) const {
    const auto base_digests = ds::digest_tensors(refs(base));
    return in::delta_digests(metas, delta.view(), base_digests, model_version, base_version);
  }
};

}  // namespace

TEST(IntegrityDigests, DeltaDigestsMatchFullRecomputeAndSkipUnchangedTensors) {
  Fixture f;
  const auto d = f.digests();
  EXPECT_EQ(d.model_version, 8u);
  EXPECT_EQ(d.base_version, 7u);
  const auto base_full = ds::digest_tensors(f.refs(f.base));
  const auto next_full = ds::digest_tensors(f.refs(f.next));
  ASSERT_EQ(d.base.size(), 2u);  // "norm" did not change
  EXPECT_FALSE(d.base.contains("norm"));
  EXPECT_EQ(d.base.at("embed"), base_full[0]);
  EXPECT_EQ(d.result.at("embed"), next_full[0]);
  EXPECT_EQ(d.result.at("mlp"), next_full[2]);

  std::vector<uint64_t> running = base_full;
  in::advance_digests(running, f.metas, f.delta.view());
  EXPECT_EQ(running, next_full);
}

TEST(IntegrityDigests, DeltaWithoutBaseValuesIsRefused) {
  Fixture f;
  ds::SparseDelta stripped = f.delta;
  stripped.base_values.clear();
  const std::vector<uint64_t> zeros(f.metas.size(), 0);
  EXPECT_THROW(in::delta_digests(f.metas, stripped.view(), zeros, 1, 0), ds::Error);
}

TEST(IntegrityMetadata, DeltaDigestsRoundTripInMemory) {
  Fixture f;
  const auto d = f.digests();
  ds::DeltaInfo info;
  in::put_delta_digests(info, d);
  EXPECT_EQ(info.model_version, 8u);
  EXPECT_EQ(info.base_version, 7u);
  EXPECT_EQ(info.extra.at("digest_algorithm"), "sum-mix64-v1");
  const auto back = in::read_delta_digests(info, "d.safetensors");
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->model_version, 8u);
  EXPECT_EQ(back->base_version, 7u);
  EXPECT_EQ(back->base, d.base);
  EXPECT_EQ(back->result, d.result);
}

TEST(IntegrityMetadata, DeltaDigestsRoundTripThroughADeltaFile) {
  Fixture f;
  const auto d = f.digests();
  ds::DeltaInfo info;
  in::put_delta_digests(info, d);
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("integrity_roundtrip_" + std::to_string(::getpid()) + ".safetensors"))
                               .string();
  ds::write_trl_delta(path, f.metas, f.delta.view(), info);
  const auto file = ds::st::File::open(path);
  const auto parsed = ds::parse_trl_delta(file);
  const auto back = in::read_delta_digests(parsed.info, path);
  std::filesystem::remove(path);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->model_version, 8u);
  EXPECT_EQ(back->base_version, 7u);
  EXPECT_EQ(back->base, d.base);
  EXPECT_EQ(back->result, d.result);
}

TEST(IntegrityMetadata, CheckpointDigestsRoundTrip) {
  Fixture f;
  const auto digests = in::digest_map(f.refs(f.base));
  ds::st::Metadata md;
  in::put_checkpoint_digests(md, digests);
  EXPECT_TRUE(md.contains("digests"));
  const auto back = in::read_checkpoint_digests(md, "a.safetensors");
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(*back, digests);
}

TEST(IntegrityMetadata, AbsentDigestsReadAsNothing) {
  ds::DeltaInfo info;
  info.extra["changed_params"] = "[]";
  EXPECT_FALSE(in::read_delta_digests(info, "x").has_value());
  EXPECT_FALSE(in::read_checkpoint_digests(info.extra, "x").has_value());
}

TEST(IntegrityMetadata, MalformedDigestMetadataIsRejected) {
  const std::string good = R"({"w": "0123456789abcdef"})";
  auto delta_with = [&](std::string base, std::string result, std::optional<std::string> alg) {
    ds::DeltaInfo info;
    info.model_version = 3;
    info.extra["base_digests"] = std::move(base);
    info.extra["result_digests"] = std::move(result);
    if (alg) info.extra["digest_algorithm"] = *alg;
    return info;
  };
  auto read = [](const ds::DeltaInfo& info) { return [info] { in::read_delta_digests(info, "d.st"); }; };

  EXPECT_NO_THROW(in::read_delta_digests(delta_with(good, good, "sum-mix64-v1"), "d.st"));
  expect_error_containing(read(delta_with("{not json", good, "sum-mix64-v1")), "d.st: metadata base_digests is not valid JSON");
  expect_error(read(delta_with("[1,2]", good, "sum-mix64-v1")), "d.st: metadata base_digests is not a JSON object");
  expect_error(read(delta_with(good, R"({"w": 12})", "sum-mix64-v1")),
               "d.st: metadata result_digests entry \"w\": 12 is not a string");
  expect_error(read(delta_with(good, R"({"w": "0123456789ABCDEF"})", "sum-mix64-v1")),
               "d.st: metadata result_digests entry \"w\": digest '0123456789ABCDEF': not 16 lowercase hex digits");
  expect_error(read(delta_with(good, R"({"w": "0123"})", "sum-mix64-v1")),
               "d.st: metadata result_digests entry \"w\": digest '0123': not 16 lowercase hex digits");
  expect_error(read(delta_with(good, R"({"v": "0123456789abcdef"})", "sum-mix64-v1")),
               "d.st: metadata result_digests has no digest for tensor w (base_digests has one)");
  expect_error(read(delta_with(good, good, std::nullopt)), "d.st: metadata has base_digests but no digest_algorithm");
  expect_error(read(delta_with(good, good, "xxh3")),
               "d.st: metadata digest_algorithm is \"xxh3\"; this build knows \"sum-mix64-v1\"");

  ds::DeltaInfo only_base;
  only_base.extra["base_digests"] = good;
  only_base.extra["digest_algorithm"] = "sum-mix64-v1";
  expect_error(read(only_base), "d.st: metadata has base_digests but no result_digests");

  ds::st::Metadata md = {{"digests", R"({"w": "zz23456789abcdef"})"}, {"digest_algorithm", "sum-mix64-v1"}};
  expect_error([&] { in::read_checkpoint_digests(md, "a.st"); },
               "a.st: metadata digests entry \"w\": digest 'zz23456789abcdef': not 16 lowercase hex digits");
  md = {{"digests", good}};
  expect_error([&] { in::read_checkpoint_digests(md, "a.st"); }, "a.st: metadata has digests but no digest_algorithm");
}

TEST(IntegrityCheckBase, MessagesNameVersionDigestAndTensor) {
  in::DeltaDigests d{12, 11, {{"a", 0x1111111111111111ull}, {"b", 0x2222222222222222ull}}, {}};
  EXPECT_NO_THROW(in::check_base(d, 11, {{"a", 0x1111111111111111ull}, {"b", 0x2222222222222222ull}}));
  EXPECT_NO_THROW(in::check_base(d, std::nullopt, {{"a", 0x1111111111111111ull}, {"b", 0x2222222222222222ull}}));
  expect_error([&] { in::check_base(d, 11, {{"a", 0x1111111111111111ull}, {"b", 0xabcdefull}}); },
               "delta 12 expects base version 11 digest 2222222222222222 for tensor b, found 0000000000abcdef");
  expect_error([&] { in::check_base(d, 10, {{"a", 0x1111111111111111ull}, {"b", 0x2222222222222222ull}}); },
               "delta 12 expects base version 11, found version 10");
  expect_error([&] { in::check_base(d, 11, {{"a", 0x1111111111111111ull}}); },
               "delta 12 expects base version 11 digest 2222222222222222 for tensor b, found no such tensor");
  d.base_version.reset();
  expect_error([&] { in::check_base(d, 5, {{"a", 0}, {"b", 0x2222222222222222ull}}); },
               "delta 12 expects base version unknown digest 1111111111111111 for tensor a, found 0000000000000000");
}

TEST(IntegrityApply, AppliesAndUpdatesDigestsInPlace) {
  Fixture f;
  const auto expected = f.digests();
  auto weights = f.base;
  auto targets = f.targets(weights);
  auto patches = f.patches();
  std::vector<uint64_t> current = ds::digest_tensors(f.refs(weights));
  const auto report = in::apply_verified(targets, patches, expected, current, 7);
  EXPECT_EQ(report.tensors_changed, 2u);
  EXPECT_EQ(report.elements_changed, f.delta.view().total_changed());
  EXPECT_EQ(weights, f.next);
  EXPECT_EQ(current, ds::digest_tensors(f.refs(f.next)));
}

TEST(IntegrityApply, Int32IndicesAsFilesStoreThem) {
  Fixture f;
  const auto expected = f.digests();
  auto weights = f.base;
  auto targets = f.targets(weights);
  auto patches = f.patches();
  std::vector<std::vector<int32_t>> narrow(patches.size());
  for (size_t t = 0; t < patches.size(); ++t) {
    const auto* wide = static_cast<const int64_t*>(patches[t].indices);
    narrow[t].assign(wide, wide + patches[t].count);
    patches[t].indices = narrow[t].data();
    patches[t].index_width = 4;
  }
  std::vector<uint64_t> current = ds::digest_tensors(f.refs(weights));
  in::apply_verified(targets, patches, expected, current, 7);
  EXPECT_EQ(weights, f.next);
  EXPECT_EQ(current, ds::digest_tensors(f.refs(f.next)));
}

TEST(IntegrityApply, WrongBaseIsRefusedWithNothingWritten) {
  Fixture f;
  const auto expected = f.digests();
  auto weights = f.base;
  // The receiver's "embed" differs from the delta's base in one element.
  weights[0][10] ^= 1;
  const auto before = weights;
  auto targets = f.targets(weights);
  auto patches = f.patches();
  std::vector<uint64_t> current = ds::digest_tensors(f.refs(weights));
  const auto current_before = current;
  expect_error([&] { in::apply_verified(targets, patches, expected, current, 7); },
               "delta 8 expects base version 7 digest " + ds::digest_to_hex(expected.base.at("embed")) +
                   " for tensor embed, found " + ds::digest_to_hex(current[0]));
  EXPECT_EQ(weights, before);
  EXPECT_EQ(current, current_before);

  // Right digests, wrong version.
  auto good = f.base;
  auto good_targets = f.targets(good);
  std::vector<uint64_t> good_current = ds::digest_tensors(f.refs(good));
  expect_error([&] { in::apply_verified(good_targets, patches, expected, good_current, 6); },
               "delta 8 expects base version 7, found version 6");
  EXPECT_EQ(good, f.base);
}

TEST(IntegrityApply, ResultMismatchRollsBackBitExactly) {
  Fixture f;
  auto expected = f.digests();
  expected.result["mlp"] ^= 0x8000000000000000ull;  // the delta promises another result
  auto weights = f.base;
  auto targets = f.targets(weights);
  auto patches = f.patches();
  std::vector<uint64_t> current = ds::digest_tensors(f.refs(weights));
  const auto current_before = current;
  const uint64_t actual = ds::digest_tensor(f.refs(f.next)[2]);
  expect_error([&] { in::apply_verified(targets, patches, expected, current, 7); },
               "delta 8 result digest mismatch for tensor mlp: expected " + ds::digest_to_hex(expected.result.at("mlp")) +
                   ", got " + ds::digest_to_hex(actual) + "; weights restored to their state before the delta");
  EXPECT_EQ(weights, f.base);  // every tensor, including "embed" which matched
  EXPECT_EQ(current, current_before);
}

TEST(IntegrityApply, InvalidPatchIsRefusedWithNothingWritten) {
  Fixture f;
  const auto expected = f.digests();
  auto weights = f.base;
  auto targets = f.targets(weights);
  auto patches = f.patches();
  // Last index of "mlp" pushed out of range.
  std::vector<int64_t> idx(static_cast<const int64_t*>(patches[2].indices),
                           static_cast<const int64_t*>(patches[2].indices) + patches[2].count);
  idx.back() = static_cast<int64_t>(f.metas[2].numel());
  patches[2].indices = idx.data();
  std::vector<uint64_t> current = ds::digest_tensors(f.refs(weights));
  EXPECT_THROW(in::apply_verified(targets, patches, expected, current, 7), ds::Error);
  EXPECT_EQ(weights, f.base);
}

TEST(IntegrityApply, DigestsMustCoverEveryChangedTensor) {
  Fixture f;
  auto expected = f.digests();
  expected.base.erase("mlp");
  expected.result.erase("mlp");
  auto weights = f.base;
  auto targets = f.targets(weights);
  auto patches = f.patches();
  std::vector<uint64_t> current = ds::digest_tensors(f.refs(weights));
  expect_error([&] { in::apply_verified(targets, patches, expected, current, 7); },
               "delta 8 changes tensor mlp but records no base/result digest for it");
  EXPECT_EQ(weights, f.base);
}

TEST(IntegrityApply, AChainOfDeltasKeepsDigestsCurrentInOChanged) {
  // Three deltas in a row; the receiver never recomputes a full digest after the first.
  Fixture f1(1);
  auto weights = f1.base;
  std::vector<uint64_t> current = ds::digest_tensors(f1.refs(weights));
  std::vector<std::vector<uint8_t>> prev = f1.base;
  for (uint64_t version = 1; version <= 3; ++version) {
    // Next state: flip a few bytes of the previous one, then encode against it.
    std::mt19937_64 rng(version);
    auto next = prev;
    for (auto& t : next)
      for (size_t k = 0; k < t.size(); k += 1 + rng() % 40) t[k] ^= static_cast<uint8_t>(1 + rng() % 255);
    auto shadow = prev;
    std::vector<ds::EncodeItem> items;
    for (size_t t = 0; t < f1.metas.size(); ++t)
      items.push_back({f1.metas[t].name, next[t].data(), shadow[t].data(), f1.metas[t].numel(), f1.metas[t].width()});
    ds::SparseDelta delta;
    ds::cpu::encode(items, delta);
    const auto expected = in::delta_digests(f1.metas, delta.view(), ds::digest_tensors(f1.refs(prev)), version, version - 1);
    auto targets = f1.targets(weights);
    std::vector<ds::PatchRef> patches;
    for (size_t t = 0; t < f1.metas.size(); ++t) patches.push_back(delta.view().patch(t, f1.metas[t].width()));
    in::apply_verified(targets, patches, expected, current, version - 1);
    EXPECT_EQ(weights, next) << version;
    prev = next;
  }
  EXPECT_EQ(current, ds::digest_tensors(f1.refs(weights)));
}

namespace {

// A transaction that writes nothing itself and reports a chosen shift per target: the policy of
// the one verified apply, seen from outside.
struct RecordingTransaction final : in::PatchTransaction {
  std::vector<uint64_t> shifts_to_report;
  int writes = 0, undos = 0;
  void write(std::span<const ds::TensorRef>, std::span<const ds::PatchRef>, std::span<uint64_t> shifts) override {
    ++writes;
    std::copy(shifts_to_report.begin(), shifts_to_report.end(), shifts.begin());
  }
  void undo(std::span<const ds::TensorRef>) override { ++undos; }
};

}  // namespace

TEST(IntegrityApply, OnePolicyOverAnyTransaction) {
  Fixture f;
  const auto expected = f.digests();
  auto weights = f.base;
  auto targets = f.targets(weights);
  auto patches = f.patches();
  const std::vector<uint64_t> before = ds::digest_tensors(f.refs(f.base));
  const std::vector<uint64_t> after = ds::digest_tensors(f.refs(f.next));
  RecordingTransaction tx;
  for (size_t t = 0; t < before.size(); ++t) tx.shifts_to_report.push_back(after[t] - before[t]);

  // The promised shifts: accepted, digests advanced, nothing undone.
  std::vector<uint64_t> current = before;
  in::apply_verified(targets, patches, expected, current, 7, tx);
  EXPECT_EQ(current, after);
  EXPECT_EQ(tx.writes, 1);
  EXPECT_EQ(tx.undos, 0);

  // A wrong base: refused before the transaction writes anything.
  current = before;
  current[2] ^= 1;
  EXPECT_THROW(in::apply_verified(targets, patches, expected, current, 7, tx), ds::Error);
  EXPECT_EQ(tx.writes, 1);

  // A shift that misses the promise: undone once, the digests left as they were.
  current = before;
  tx.shifts_to_report[2] += 1;
  expect_error_containing([&] { in::apply_verified(targets, patches, expected, current, 7, tx); },
                          "result digest mismatch for tensor mlp");
  EXPECT_EQ(tx.writes, 2);
  EXPECT_EQ(tx.undos, 1);
  EXPECT_EQ(current, before);
}
