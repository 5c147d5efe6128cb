// Integrity metadata and the transactional verified apply: a wrong base is refused with the
// exact message and nothing written, a wrong result is rolled back bit for bit, digest metadata
// round-trips (in memory and through a delta file) and malformed metadata is rejected.
#include <gtest/gtest.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <thread>
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
  // Found by fuzz_anchor_load: a number too large for a double is nlohmann's out_of_range, not a
  // parse_error, and escaped as an uncaught exception (std::terminate) before.
  expect_error_containing(read(delta_with(R"({"w": 1e3918831})", good, "sum-mix64-v1")),
                          "d.st: metadata base_digests is not valid JSON");
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

namespace {

// An all-reduce (sum mod 2^64) between two threads standing in for two tensor-parallel ranks.
class TwoRankSum {
 public:
  void all_reduce(std::span<uint64_t> v) {
    std::unique_lock lock(mutex_);
    if (arrived_ == 0) sum_.assign(v.size(), 0);
    for (size_t i = 0; i < v.size(); ++i) sum_[i] += v[i];
    if (++arrived_ == 2) {
      done_ = true;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return done_; });
    }
    std::copy(sum_.begin(), sum_.end(), v.begin());
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<uint64_t> sum_;
  int arrived_ = 0;
  bool done_ = false;
};

// One rank of two: holds every element (a replicated model), owns half of each tensor's
// elements for digests (rank 0 the first half, rank 1 the rest), so its shifts are partials
// that agree() sums with the other rank's, refusals in one slot more.
class RankTransaction final : public in::PatchTransaction {
 public:
  RankTransaction(int rank, TwoRankSum& sum) : rank_(rank), sum_(sum) {}
  int agreements = 0, undos = 0;

  void write(std::span<const ds::TensorRef> targets, std::span<const ds::PatchRef> patches,
             std::span<uint64_t> shifts) override {
    saved_.clear();
    for (const auto& t : targets) {
      const auto* bytes = static_cast<const uint8_t*>(t.data);
      saved_.emplace_back(bytes, bytes + t.numel * t.width);
    }
    ds::cpu::apply(targets, patches);
    for (size_t t = 0; t < targets.size(); ++t) {
      const uint64_t half = targets[t].numel / 2, first = rank_ == 0 ? 0 : half;
      const uint64_t count = rank_ == 0 ? half : targets[t].numel - half;
      const uint32_t w = targets[t].width;
      shifts[t] = ds::digest_slice(w, static_cast<const uint8_t*>(targets[t].data) + first * w, first, count) -
                  ds::digest_slice(w, saved_[t].data() + first * w, first, count);
    }
  }
  void undo(std::span<const ds::TensorRef> targets) override {
    ++undos;
    for (size_t t = 0; t < targets.size(); ++t) std::memcpy(targets[t].data, saved_[t].data(), saved_[t].size());
  }
  uint64_t agree(std::span<uint64_t> shifts, bool refuse) override {
    ++agreements;
    std::vector<uint64_t> slots(shifts.begin(), shifts.end());
    slots.push_back(refuse ? 1 : 0);
    sum_.all_reduce(slots);
    std::copy(slots.begin(), slots.end() - 1, shifts.begin());
    return slots.back();
  }

 private:
  int rank_;
  TwoRankSum& sum_;
  std::vector<std::vector<uint8_t>> saved_;
};

struct RankOutcome {
  std::vector<std::vector<uint8_t>> weights;
  std::vector<uint64_t> current;
  std::string error;
  int agreements = 0, undos = 0;
};

// Both ranks apply the fixture's delta at once; `bad_base_rank` (if 0 or 1) holds other weights
// than the delta's base in one element of "embed".
std::vector<RankOutcome> apply_on_two_ranks(const Fixture& f, const in::DeltaDigests& expected, int bad_base_rank) {
  TwoRankSum sum;
  std::vector<RankOutcome> out(2);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < 2; ++rank)
    ranks.emplace_back([&, rank] {
      RankOutcome& o = out[rank];
      o.weights = f.base;
      if (rank == bad_base_rank) o.weights[0][10] ^= 1;
      o.current = ds::digest_tensors(f.refs(o.weights));
      auto targets = f.targets(o.weights);
      const auto patches = f.patches();
      RankTransaction tx(rank, sum);
      try {
        in::apply_verified(targets, patches, expected, o.current, 7, tx);
      } catch (const ds::Error& e) {
        o.error = e.what();
      }
      o.agreements = tx.agreements;
      o.undos = tx.undos;
    });
  for (auto& r : ranks) r.join();
  return out;
}

}  // namespace

TEST(IntegrityApply, TwoRanksSumTheirShiftsAndApply) {
  Fixture f;
  const auto out = apply_on_two_ranks(f, f.digests(), -1);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(out[rank].error, "") << rank;
    EXPECT_EQ(out[rank].weights, f.next) << rank;
    // Each rank's digests are the whole tensors' (the two halves summed), not its partials.
    EXPECT_EQ(out[rank].current, ds::digest_tensors(f.refs(f.next))) << rank;
    EXPECT_EQ(out[rank].agreements, 1) << rank;
    EXPECT_EQ(out[rank].undos, 0) << rank;
  }
}

TEST(IntegrityApply, ARankThatRefusesBeforeWritingRollsBackTheOther) {
  // Rank 1 holds another base: it refuses in check_before_apply, writes nothing, and still takes
  // part in the one agreement; rank 0, which wrote, hears of the refusal and undoes its write.
  Fixture f;
  const auto expected = f.digests();
  const auto out = apply_on_two_ranks(f, expected, 1);
  EXPECT_EQ(out[0].error, "delta 8: refused by 1 other rank(s); weights restored to their state before the delta");
  EXPECT_EQ(out[0].weights, f.base);
  EXPECT_EQ(out[0].current, ds::digest_tensors(f.refs(f.base)));
  EXPECT_EQ(out[0].undos, 1);
  EXPECT_NE(out[1].error.find("delta 8 expects base version 7 digest"), std::string::npos) << out[1].error;
  auto bad = f.base;
  bad[0][10] ^= 1;
  EXPECT_EQ(out[1].weights, bad);
  EXPECT_EQ(out[1].undos, 0);
  for (int rank = 0; rank < 2; ++rank) EXPECT_EQ(out[rank].agreements, 1) << rank;
}

TEST(IntegrityApply, AResultMismatchAcrossTheRanksRollsBackBoth) {
  // Neither rank alone can see the mismatch (each holds a partial); the summed shifts miss the
  // promise on both, so both undo.
  Fixture f;
  auto expected = f.digests();
  expected.result["embed"] += 1;
  const auto out = apply_on_two_ranks(f, expected, -1);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(out[rank].error.find("result digest mismatch for tensor embed"), std::string::npos) << out[rank].error;
    EXPECT_EQ(out[rank].weights, f.base) << rank;
    EXPECT_EQ(out[rank].undos, 1) << rank;
    EXPECT_EQ(out[rank].agreements, 1) << rank;
  }
}

TEST(IntegrityApply, ATargetTheTransactionDoesNotHoldTakesThePromisedResult) {
  Fixture f;
  const auto expected = f.digests();
  auto weights = f.base;
  auto targets = f.targets(weights);
  const auto patches = f.patches();
  const std::vector<uint64_t> before = ds::digest_tensors(f.refs(f.base));
  const std::vector<uint64_t> after = ds::digest_tensors(f.refs(f.next));
  struct Unheld final : in::PatchTransaction {
    void write(std::span<const ds::TensorRef>, std::span<const ds::PatchRef>, std::span<uint64_t> shifts) override {
      shifts[0] = shift0;  // "mlp" (2) is held nowhere: no shift for it
    }
    void undo(std::span<const ds::TensorRef>) override {}
    bool holds(size_t target) const override { return target != 2; }
    uint64_t shift0 = 0;
  } tx;
  tx.shift0 = after[0] - before[0];
  std::vector<uint64_t> current = before;
  in::apply_verified(targets, patches, expected, current, 7, tx);
  EXPECT_EQ(current[0], after[0]);
  EXPECT_EQ(current[2], expected.result.at("mlp"));
}

TEST(IntegrityApply, ARefusalOfUnresolvableInputStillTakesPartInTheAgreement) {
  Fixture f;
  TwoRankSum sum;
  const auto expected = f.digests();
  std::string errors[2];
  int agreements[2] = {0, 0};
  std::vector<std::vector<uint8_t>> weights0 = f.base;
  std::thread rank1([&] {
    RankTransaction tx(1, sum);
    try {
      in::refuse_apply(f.metas.size(), std::make_exception_ptr(ds::BadInputError("delta.safetensors: unreadable")), tx);
    } catch (const ds::Error& e) {
      errors[1] = e.what();
    }
    agreements[1] = tx.agreements;
  });
  {
    RankTransaction tx(0, sum);
    auto targets = f.targets(weights0);
    std::vector<uint64_t> current = ds::digest_tensors(f.refs(f.base));
    try {
      in::apply_verified(targets, f.patches(), expected, current, 7, tx);
    } catch (const ds::Error& e) {
      errors[0] = e.what();
    }
    agreements[0] = tx.agreements;
  }
  rank1.join();
  EXPECT_EQ(errors[1], "delta.safetensors: unreadable");
  EXPECT_NE(errors[0].find("refused by 1 other rank(s)"), std::string::npos) << errors[0];
  EXPECT_EQ(weights0, f.base);
  EXPECT_EQ(agreements[0], 1);
  EXPECT_EQ(agreements[1], 1);
}
