// Randomized property tests of the CPU twin against a naive element-by-element reference:
// sizes around block boundaries, nothing/everything changed, signed zeros and NaN payloads, all
// element widths, many tensors at once.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/cpu_engine.hpp"
#include "core/error.hpp"
#include "test_support.hpp"

using namespace deltasync;

namespace {

struct Case {
  uint32_t width;
  std::vector<uint8_t> base, current;
};

// Current = base with each element changed with probability `share` (a random other pattern).
Case make_case(uint32_t width, uint64_t numel, double share, std::mt19937_64& rng) {
  Case c{width, std::vector<uint8_t>(numel * width), {}};
  for (auto& b : c.base) b = static_cast<uint8_t>(rng());
  c.current = c.base;
  std::bernoulli_distribution changed(share);
  for (uint64_t i = 0; i < numel; ++i) {
    if (!changed(rng)) continue;
    uint8_t* e = c.current.data() + i * width;
    do {
      e[rng() % width] ^= static_cast<uint8_t>(1u + rng() % 255u);
    } while (std::memcmp(e, c.base.data() + i * width, width) == 0);
  }
  return c;
}

// The obvious loop: what encode must produce.
SparseDelta reference_encode(const std::vector<Case>& cases) {
  SparseDelta d;
  d.offsets.push_back(0);
  d.value_offsets.push_back(0);
  for (const auto& c : cases) {
    const uint64_t n = c.base.size() / c.width;
    for (uint64_t i = 0; i < n; ++i) {
      const uint8_t* a = c.base.data() + i * c.width;
      const uint8_t* b = c.current.data() + i * c.width;
      if (std::memcmp(a, b, c.width) == 0) continue;
      d.indices.push_back(static_cast<int64_t>(i));
      d.values.insert(d.values.end(), b, b + c.width);
      d.base_values.insert(d.base_values.end(), a, a + c.width);
    }
    d.offsets.push_back(d.indices.size());
    d.value_offsets.push_back(d.values.size());
  }
  return d;
}

void expect_same(const SparseDelta& got, const SparseDelta& want) {
  EXPECT_EQ(got.offsets, want.offsets);
  EXPECT_EQ(got.value_offsets, want.value_offsets);
  EXPECT_EQ(got.indices, want.indices);
  EXPECT_EQ(got.values, want.values);
  EXPECT_EQ(got.base_values, want.base_values);
}

// Encodes `cases` (shadow = base), checks against the reference and that shadow == current.
void check_encode(std::vector<Case> cases) {
  const SparseDelta want = reference_encode(cases);
  std::vector<std::vector<uint8_t>> shadows;
  std::vector<std::string> names;
  for (size_t t = 0; t < cases.size(); ++t) {
    shadows.push_back(cases[t].base);
    names.push_back("t" + std::to_string(t));
  }
  std::vector<EncodeItem> items;
  for (size_t t = 0; t < cases.size(); ++t)
    items.push_back({names[t], cases[t].current.data(), shadows[t].data(), cases[t].base.size() / cases[t].width, cases[t].width});
  SparseDelta got;
  cpu::encode(items, got);
  expect_same(got, want);
  for (size_t t = 0; t < cases.size(); ++t) EXPECT_EQ(shadows[t], cases[t].current) << "shadow of tensor " << t;

  // Applying the delta to a copy of the base reproduces current bit for bit.
  std::vector<std::vector<uint8_t>> targets;
  for (const auto& c : cases) targets.push_back(c.base);
  std::vector<TensorRef> refs;
  std::vector<PatchRef> patches;
  for (size_t t = 0; t < cases.size(); ++t) {
    refs.push_back({names[t], targets[t].data(), cases[t].base.size() / cases[t].width, cases[t].width});
    patches.push_back(got.view().patch(t, cases[t].width));
  }
  cpu::apply(refs, patches);
  for (size_t t = 0; t < cases.size(); ++t) EXPECT_EQ(targets[t], cases[t].current) << "applied tensor " << t;

  // A second encode with nothing new finds nothing.
  SparseDelta again;
  cpu::encode(items, again);
  EXPECT_TRUE(again.indices.empty());
  EXPECT_EQ(again.offsets, std::vector<uint64_t>(cases.size() + 1, 0));
}

}  // namespace

class EncodeWidth : public ::testing::TestWithParam<uint32_t> {};

TEST_P(EncodeWidth, SizesAroundBlockAndTaskBoundaries) {
  const uint32_t w = GetParam();
  std::mt19937_64 rng(1234 + w);
  for (uint64_t n : {0ull, 1ull, 2ull, 3ull, 7ull, 15ull, 16ull, 17ull, 31ull, 32ull, 33ull, 63ull, 64ull, 65ull, 127ull,
                     1000ull, 4097ull, (1ull << 20) - 1, (1ull << 20) + 1})
    check_encode({make_case(w, n, 0.05, rng)});
}

TEST_P(EncodeWidth, NothingChanged) {
  std::mt19937_64 rng(7);
  check_encode({make_case(GetParam(), 100003, 0.0, rng)});
}

TEST_P(EncodeWidth, EverythingChanged) {
  std::mt19937_64 rng(8);
  check_encode({make_case(GetParam(), 70001, 1.0, rng)});
}

TEST_P(EncodeWidth, DensitiesFromSparseToDense) {
  std::mt19937_64 rng(9);
  for (double share : {0.001, 0.01, 0.1, 0.5, 0.9}) check_encode({make_case(GetParam(), 3u << 20, share, rng)});
}

INSTANTIATE_TEST_SUITE_P(Widths, EncodeWidth, ::testing::Values(1u, 2u, 4u));

TEST(Encode, ManyTensorsOfMixedWidths) {
  std::mt19937_64 rng(10);
  std::vector<Case> cases;
  for (int t = 0; t < 300; ++t) {
    const uint32_t w = 1u << (t % 3);
    cases.push_back(make_case(w, rng() % 5000, (t % 7) / 10.0, rng));
  }
  check_encode(std::move(cases));
}

TEST(Encode, SignedZerosAndNanPayloadsAreChanges) {
  // bf16: +0.0, -0.0, quiet NaN with two payloads, +inf; f32 likewise.
  std::vector<uint16_t> base16 = {0x0000, 0x8000, 0x7FC0, 0x7FC1, 0x7F80, 0x3F80};
  std::vector<uint16_t> cur16 = {0x8000, 0x0000, 0x7FC1, 0x7FC1, 0x7F80, 0x3F81};
  std::vector<uint32_t> base32 = {0x00000000u, 0x7FC00000u, 0x7FC00001u};
  std::vector<uint32_t> cur32 = {0x80000000u, 0x7FC00001u, 0x7FC00001u};
  Case a{2, {}, {}}, b{4, {}, {}};
  a.base.assign(reinterpret_cast<uint8_t*>(base16.data()), reinterpret_cast<uint8_t*>(base16.data() + base16.size()));
  a.current.assign(reinterpret_cast<uint8_t*>(cur16.data()), reinterpret_cast<uint8_t*>(cur16.data() + cur16.size()));
  b.base.assign(reinterpret_cast<uint8_t*>(base32.data()), reinterpret_cast<uint8_t*>(base32.data() + base32.size()));
  b.current.assign(reinterpret_cast<uint8_t*>(cur32.data()), reinterpret_cast<uint8_t*>(cur32.data() + cur32.size()));
  const SparseDelta want = reference_encode({a, b});
  EXPECT_EQ(want.indices, (std::vector<int64_t>{0, 1, 2, 5, 0, 1}));
  check_encode({a, b});
}

TEST(Encode, RejectsBadWidth) {
  uint8_t x[3] = {}, y[3] = {};
  EncodeItem item{"odd", x, y, 1, 3};
  SparseDelta d;
  try {
    cpu::encode({&item, 1}, d);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor odd"), std::string::npos) << e.what();
  }
}

namespace {

// Applies `patch` to a 10-element bf16 tensor "w" (after an untouched tensor "a") and expects
// an error containing `message`, with neither tensor written.
void expect_rejected(const std::vector<int64_t>& indices, uint32_t value_width, const std::string& message) {
  std::vector<uint16_t> a(4, 0x1111), w(10, 0x2222);
  const auto a0 = a, w0 = w;
  std::vector<uint8_t> values(indices.size() * value_width, 0xAB);
  std::vector<int64_t> a_idx = {0, 3};
  std::vector<uint16_t> a_val = {1, 2};
  TensorRef targets[] = {{"a", a.data(), a.size(), 2}, {"w", w.data(), w.size(), 2}};
  PatchRef patches[] = {{2, a_idx.data(), 8, a_val.data(), 2}, {indices.size(), indices.data(), 8, values.data(), value_width}};
  try {
    cpu::apply(targets, patches);
    FAIL() << "expected: " << message;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
  EXPECT_EQ(a, a0);
  EXPECT_EQ(w, w0);
}

}  // namespace

TEST(Apply, RejectsOutOfRangeIndexAndWritesNothing) {
  expect_rejected({1, 5, 10}, 2, "tensor w: index 10 out of range [0, 10)");
  expect_rejected({-1}, 2, "tensor w: index -1 out of range");
}

TEST(Apply, RejectsUnsortedOrRepeatedIndices) {
  expect_rejected({1, 5, 5}, 2, "tensor w: indices not strictly ascending at position 2");
  expect_rejected({3, 2}, 2, "tensor w: indices not strictly ascending at position 1");
}

TEST(Apply, RejectsWidthMismatch) { expect_rejected({1}, 4, "tensor w: values are 4-byte but the tensor is 2-byte"); }

TEST(Apply, AcceptsInt32IndicesAndLongPatchesAcrossTasks) {
  const uint64_t n = 3u << 20;
  std::vector<uint32_t> target(n, 0);
  std::vector<int32_t> idx;
  std::vector<uint32_t> val;
  for (uint64_t i = 0; i < n; i += 2) {
    idx.push_back(static_cast<int32_t>(i));
    val.push_back(static_cast<uint32_t>(i * 7 + 1));
  }
  TensorRef t{"big", target.data(), n, 4};
  PatchRef p{idx.size(), idx.data(), 4, val.data(), 4};
  cpu::apply({&t, 1}, {&p, 1});
  for (uint64_t i = 0; i < n; ++i) ASSERT_EQ(target[i], i % 2 ? 0u : static_cast<uint32_t>(i * 7 + 1)) << i;
  // A descent exactly at a task boundary (position 2^18) is caught too.
  std::swap(idx[1u << 18], idx[(1u << 18) - 1]);
  EXPECT_THROW(cpu::apply({&t, 1}, {&p, 1}), Error);
}

TEST(Gather, EveryWidthAndIndexWidthInAnyOrderAcrossTasksMatchesAnElementLoop) {
  std::mt19937_64 rng(5);
  for (const uint32_t width : {1u, 2u, 4u})
    for (const uint32_t index_width : {4u, 8u}) {
      // Two tensors; the second's positions span several gather tasks (2^18 each), unsorted, repeated.
      const uint64_t small = 1000, big = 3u << 19;
      std::vector<uint8_t> a(small * width), b(big * width);
      for (auto& x : a) x = static_cast<uint8_t>(rng());
      for (auto& x : b) x = static_cast<uint8_t>(rng());
      std::vector<int64_t> pa{0, 999, 5, 5}, pb;
      for (uint64_t k = 0; k < big / 2 + 7; ++k) pb.push_back(static_cast<int64_t>(rng() % big));
      std::vector<int32_t> pa32(pa.begin(), pa.end()), pb32(pb.begin(), pb.end());
      const void* ia = index_width == 8 ? static_cast<const void*>(pa.data()) : pa32.data();
      const void* ib = index_width == 8 ? static_cast<const void*>(pb.data()) : pb32.data();
      ConstTensorRef sources[] = {{"a", a.data(), small, width}, {"b", b.data(), big, width}};
      PatchRef where[] = {{pa.size(), ia, index_width, nullptr, width}, {pb.size(), ib, index_width, nullptr, width}};
      std::vector<uint8_t> out((pa.size() + pb.size()) * width), expected;
      for (int64_t i : pa) expected.insert(expected.end(), a.begin() + i * width, a.begin() + (i + 1) * width);
      for (int64_t i : pb) expected.insert(expected.end(), b.begin() + i * width, b.begin() + (i + 1) * width);
      cpu::gather(sources, where, out);
      ASSERT_EQ(out, expected) << "width " << width << ", index width " << index_width;
    }
}

TEST(Gather, NamesTheFirstPositionOutsideItsTensorInPatchOrder) {
  std::vector<uint16_t> a(10), b(1u << 20);
  // b's bad positions lie in tasks 0 and 2 (2^18 positions each); a's comes first in patch order.
  std::vector<int64_t> pa{3, 10}, pb(600000, 1);
  pb[100000] = -2;
  pb[590000] = int64_t{1} << 20;
  ConstTensorRef sources[] = {{"a", a.data(), a.size(), 2}, {"b", b.data(), b.size(), 2}};
  PatchRef where[] = {{pa.size(), pa.data(), 8, nullptr, 2}, {pb.size(), pb.data(), 8, nullptr, 2}};
  std::vector<uint8_t> out((pa.size() + pb.size()) * 2);
  EXPECT_EQ(error_message([&] { cpu::gather(sources, where, out); }), "gather: tensor a: position 10 out of range");
  pa[1] = 9;
  EXPECT_EQ(error_message([&] { cpu::gather(sources, where, out); }), "gather: tensor b: position -2 out of range");
  pb[100000] = 7;
  EXPECT_EQ(error_message([&] { cpu::gather(sources, where, out); }), "gather: tensor b: position 1048576 out of range");
  std::vector<uint8_t> short_out(out.size() - 1);
  EXPECT_EQ(error_message([&] { cpu::gather(sources, where, short_out); }), "gather: output too small");
}

TEST(Gather, ChecksWidthsBeforeTheOutputAndThePositions) {
  // gather_layout, which every engine's gather runs first: element width, index width, then
  // the output's size; and where each tensor's bits go.
  std::vector<uint16_t> a(10);
  std::vector<uint32_t> b(10);
  std::vector<int64_t> pa{1, 2}, pb{3};
  ConstTensorRef sources[] = {{"a", a.data(), a.size(), 2}, {"b", b.data(), b.size(), 4}};
  PatchRef where[] = {{pa.size(), pa.data(), 8, nullptr, 2}, {pb.size(), pb.data(), 8, nullptr, 4}};
  EXPECT_EQ(cpu::gather_layout(sources, where, 8), (std::vector<uint64_t>{0, 4, 8}));
  EXPECT_EQ(error_message([&] { cpu::gather_layout(sources, where, 7); }), "gather: output too small");
  where[1].index_width = 2;
  EXPECT_EQ(error_message([&] { cpu::gather_layout(sources, where, 7); }), "gather: tensor b: index width 2 is not 4 or 8 bytes");
  sources[0].width = 8;
  EXPECT_EQ(error_message([&] { cpu::gather_layout(sources, where, 7); }), "gather: tensor a: element width 8 is not 1, 2 or 4 bytes");
}
