// The vLLM receiver (sync/mapped_receiver.hpp) on one rank, through a real publisher and
// subscriber over a folder store, on the layouts whose writes take different paths: a tensor
// placed further on in a fused parameter (written at its own indices into the parameter seen
// from there), a tensor whose halves sit in swapped order in its parameter (one half at shifted
// positions), and a tensor served by two parameters (each of its elements written twice: the
// old bits of its first write kept for an undo). Both formats a receiver reads; and a delta whose promised
// result is wrong is undone, leaving every runtime byte as it was.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>

#include "core/error.hpp"
#include "engine/cpu_sync_engine.hpp"
#include "codec/compact_codec.hpp"
#include "codec/digest.hpp"
#include "engine/integrity.hpp"
#include "store/store.hpp"
#include "sync/mapped_receiver.hpp"
#include "sync/publisher.hpp"
#include "sync/subscriber.hpp"
#include "test_support.hpp"

using namespace deltasync;

namespace {

// Published: q [8,16] and k [4,16] (fused into qkv: q at row 0, k at row 8), emb [32,16] (its
// second half first in its parameter), norm [16] (served twice: norm_a and norm_b).
struct Layout {
  std::vector<TensorMeta> hf{{"q", DType::BF16, {8, 16}},
                             {"k", DType::BF16, {4, 16}},
                             {"emb", DType::BF16, {32, 16}},
                             {"norm", DType::BF16, {16}}};
  std::vector<std::vector<uint16_t>> weights;                // the trainer's, per HF tensor
  std::vector<std::vector<uint16_t>> runtime;                // qkv, emb, norm_a, norm_b
  std::vector<std::string> runtime_names{"qkv", "emb", "norm_a", "norm_b"};
  bool norm_twice = true;  // false: norm_b holds nothing (every HF element written once)

  explicit Layout(bool twice = true)
      : runtime{std::vector<uint16_t>(12 * 16), std::vector<uint16_t>(32 * 16), std::vector<uint16_t>(16), std::vector<uint16_t>(16)},
        norm_twice(twice) {
    for (size_t t = 0; t < hf.size(); ++t) {
      const auto bytes = random_bytes(hf[t].numel() * 2, 11 + t);
      weights.emplace_back(hf[t].numel());
      std::memcpy(weights[t].data(), bytes.data(), bytes.size());
      for (auto& w : weights[t]) w = static_cast<uint16_t>(0x3c00 | (w & 0x83ff));  // finite bf16
    }
  }

  MappedModel model() {
    MappedModel m;
    m.hf = hf;
    // Descriptions first: a parameter's name views its description's, which must not move.
    for (size_t k = 0; k < runtime.size(); ++k) m.params_meta.push_back(TensorMeta{runtime_names[k], DType::BF16, {runtime[k].size()}});
    for (size_t k = 0; k < runtime.size(); ++k) m.params.push_back(TensorRef{m.params_meta[k].name, runtime[k].data(), runtime[k].size(), 2});
    m.runs.push_back(MappedRuns{0, 0, {0}, {128}, {0}});
    m.runs.push_back(MappedRuns{1, 0, {0}, {64}, {128}});
    m.runs.push_back(MappedRuns{2, 1, {0, 256}, {256, 256}, {256, 0}});
    m.runs.push_back(MappedRuns{3, 2, {0}, {16}, {0}});
    if (norm_twice) m.runs.push_back(MappedRuns{3, 3, {0}, {16}, {0}});
    for (uint32_t t = 0; t < 4; ++t) m.owned.push_back(OwnedRanges{t, {0}, {static_cast<int64_t>(hf[t].numel())}});
    return m;
  }

  // The runtime parameters as they must be for the trainer's weights.
  std::vector<std::vector<uint16_t>> expected_runtime() const {
    std::vector<std::vector<uint16_t>> out = runtime;
    std::copy(weights[0].begin(), weights[0].end(), out[0].begin());
    std::copy(weights[1].begin(), weights[1].end(), out[0].begin() + 128);
    std::copy(weights[2].begin(), weights[2].begin() + 256, out[1].begin() + 256);
    std::copy(weights[2].begin() + 256, weights[2].end(), out[1].begin());
    out[2] = weights[3];
    if (norm_twice) out[3] = weights[3];
    return out;
  }

  std::vector<ConstTensorRef> current() const {
    std::vector<ConstTensorRef> out;
    for (size_t t = 0; t < hf.size(); ++t) out.push_back(ConstTensorRef{hf[t].name, weights[t].data(), weights[t].size(), 2});
    return out;
  }

  // Moves `share` of every tensor's elements by one ulp (at least one each).
  void step(double share, std::mt19937_64& rng) {
    for (auto& w : weights) {
      const uint64_t n = std::max<uint64_t>(1, static_cast<uint64_t>(share * static_cast<double>(w.size())));
      for (uint64_t k = 0; k < n; ++k) {
        uint16_t& e = w[rng() % w.size()];
        e = static_cast<uint16_t>(e + ((rng() & 1) ? 1 : -1));
      }
    }
  }
};

class MappedReceiverFormats : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(MappedReceiverFormats, EveryLayoutOfTheRunsHoldsThePublishedWeightsAfterEachDelta) {
  TempDir dir;
  // norm served once: every row written once (the old bits gathered straight into row order).
  Layout layout(std::get<1>(GetParam()));
  std::shared_ptr<Store> store = open_store("file://" + dir.path().string());
  PublisherOptions options;
  options.anchor_every = 0;
  options.anchor_share = 1e9;
  options.delta_format = std::get<0>(GetParam());
  Publisher publisher(store, layout.hf, options);
  engine::CpuSyncEngine engine;
  MappedReceiver receiver(layout.model(), engine, nullptr);
  Subscriber subscriber(*store);
  std::mt19937_64 rng(3);
  publisher.publish(0, layout.current());
  publisher.flush();
  subscriber.sync(receiver);
  ASSERT_EQ(layout.runtime, layout.expected_runtime());
  // Shares from one element per tensor to most of them; a delta after a larger one reuses its arrays.
  uint64_t version = 0;
  for (const double share : {0.01, 0.6, 0.05, 0.3}) {
    layout.step(share, rng);
    publisher.publish(++version, layout.current());
    publisher.flush();
    const SyncReport report = subscriber.sync(receiver);
    ASSERT_EQ(report.deltas, std::vector<uint64_t>{version}) << "share " << share;
    // norm's changes written twice (two parameters) count twice.
    if (layout.norm_twice)
      EXPECT_GT(report.applied_elements, report.changed_elements);
    else
      EXPECT_EQ(report.applied_elements, report.changed_elements);
    ASSERT_EQ(layout.runtime, layout.expected_runtime()) << "share " << share;
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, MappedReceiverFormats,
                         ::testing::Combine(::testing::Values("compact", "trl"), ::testing::Bool()));

class MappedReceiverUndo : public ::testing::TestWithParam<bool> {};

// A receiver of the layout holding the anchor of version 0, published to a folder store.
struct AtAnchor {
  TempDir dir;
  Layout layout;
  std::shared_ptr<Store> store = open_store("file://" + dir.path().string());
  engine::CpuSyncEngine engine;
  MappedReceiver receiver;
  explicit AtAnchor(bool norm_twice) : layout(norm_twice), receiver(layout.model(), engine, nullptr) {
    Publisher publisher(store, layout.hf, PublisherOptions{});
    publisher.publish(0, layout.current());
    publisher.flush();
    Subscriber(*store).sync(receiver);
  }
};

// Through apply_patches (the patches copied): every element of every tensor changes.
TEST_P(MappedReceiverUndo, ADeltaWhoseResultDigestIsWrongIsUndoneEverywhereItWrote) {
  AtAnchor a(GetParam());
  Layout& layout = a.layout;
  MappedReceiver& receiver = a.receiver;
  const auto before = layout.runtime;

  // Every element of every tensor changes (each written where it lives: both halves of emb, both
  // copies of norm, k further on in qkv), with one result digest promised wrong.
  std::vector<std::vector<int64_t>> index(layout.hf.size());
  std::vector<std::vector<uint16_t>> values(layout.hf.size());
  std::vector<PatchRef> patches;
  integrity::DeltaDigests expected;
  expected.model_version = 1;
  expected.base_version = 0;
  const std::vector<uint64_t> digests = receiver.digests();
  for (size_t t = 0; t < layout.hf.size(); ++t) {
    for (uint64_t i = 0; i < layout.hf[t].numel(); ++i) {
      index[t].push_back(static_cast<int64_t>(i));
      values[t].push_back(static_cast<uint16_t>(layout.weights[t][i] ^ 1));
    }
    patches.push_back(PatchRef{index[t].size(), index[t].data(), 8, values[t].data(), 2});
    expected.base[layout.hf[t].name] = digests[t];
    expected.result[layout.hf[t].name] =
        digest_update(digests[t], 2, index[t].size(), index[t].data(), layout.weights[t].data(), values[t].data());
  }
  expected.result["emb"] += 1;
  engine::TransferCounters transfer;
  EXPECT_NE(error_message([&] { receiver.apply_patches(patches, expected, false, transfer); }).find("result digest mismatch for tensor emb"),
            std::string::npos);
  EXPECT_EQ(layout.runtime, before);
  EXPECT_EQ(receiver.version(), std::optional<uint64_t>{0});

  // The same changes with the right promise land everywhere.
  expected.result["emb"] -= 1;
  EXPECT_EQ(receiver.apply_patches(patches, expected, false, transfer), 128u + 64u + 512u + (layout.norm_twice ? 2 : 1) * 16u);
  layout.weights = values;
  EXPECT_EQ(layout.runtime, layout.expected_runtime());
}

INSTANTIATE_TEST_SUITE_P(NormTwice, MappedReceiverUndo, ::testing::Bool());

// Through apply() of a compact delta (decoded into the receiver's own arrays, rebased there in
// place): a wrong result digest puts every written byte back, and the right one then applies.
TEST_P(MappedReceiverUndo, ACompactDeltaWhoseResultDigestIsWrongIsUndone) {
  AtAnchor a(GetParam());
  Layout& layout = a.layout;
  MappedReceiver& receiver = a.receiver;
  const auto before = layout.runtime;

  // A third of every tensor's elements move by one ulp.
  SparseDelta delta;
  delta.offsets.push_back(0);
  delta.value_offsets.push_back(0);
  integrity::DeltaDigests digests;
  digests.model_version = 1;
  digests.base_version = 0;
  const std::vector<uint64_t> current = receiver.digests();
  auto next = layout.weights;
  for (size_t t = 0; t < layout.hf.size(); ++t) {
    std::vector<int64_t> idx;
    for (uint64_t i = 0; i < layout.hf[t].numel(); i += 3) {
      idx.push_back(static_cast<int64_t>(i));
      next[t][i] = static_cast<uint16_t>(next[t][i] + 1);
      delta.indices.push_back(static_cast<int64_t>(i));
      for (const uint16_t v : {next[t][i], layout.weights[t][i]}) {
        std::vector<uint8_t>& to = v == next[t][i] ? delta.values : delta.base_values;
        to.push_back(static_cast<uint8_t>(v));
        to.push_back(static_cast<uint8_t>(v >> 8));
      }
    }
    delta.offsets.push_back(delta.indices.size());
    delta.value_offsets.push_back(delta.values.size());
    digests.base[layout.hf[t].name] = current[t];
    std::vector<uint16_t> old_bits, new_bits;
    for (int64_t i : idx) {
      old_bits.push_back(layout.weights[t][static_cast<size_t>(i)]);
      new_bits.push_back(next[t][static_cast<size_t>(i)]);
    }
    digests.result[layout.hf[t].name] = digest_update(current[t], 2, idx.size(), idx.data(), old_bits.data(), new_bits.data());
  }
  auto file_with = [&](const integrity::DeltaDigests& promised) {
    DeltaInfo info;
    info.model_version = 1;
    info.base_version = 0;
    integrity::put_delta_digests(info, promised);
    return compact::serialize_compact_delta(layout.hf, delta.view(), info);
  };
  engine::TransferCounters transfer;
  integrity::DeltaDigests wrong = digests;
  wrong.result["k"] += 1;
  const std::vector<uint8_t> bad = file_with(wrong);
  const st::File bad_file = st::File::from_bytes(bad, "bad.safetensors");
  EXPECT_NE(error_message([&] { receiver.apply(engine::DeltaToApply{&bad_file, 1, 0}, transfer); }).find("result digest mismatch for tensor k"),
            std::string::npos);
  EXPECT_EQ(layout.runtime, before);
  EXPECT_EQ(receiver.version(), std::optional<uint64_t>{0});

  const std::vector<uint8_t> good = file_with(digests);
  const st::File good_file = st::File::from_bytes(good, "good.safetensors");
  receiver.apply(engine::DeltaToApply{&good_file, 1, 0}, transfer);
  layout.weights = next;
  EXPECT_EQ(layout.runtime, layout.expected_runtime());
  EXPECT_EQ(receiver.version(), std::optional<uint64_t>{1});
}

}  // namespace
