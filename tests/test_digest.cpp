// The per-tensor digest: known answers (so the definition never changes silently), order and
// chunking independence, O(changed) updates equal to recomputation, sensitivity to every bit
// pattern (±0, NaN payloads), 2^32-element block seeds, hex text form.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "codec/digest.hpp"
#include "codec/digest_mix.hpp"
#include "core/error.hpp"

namespace ds = deltasync;

namespace {

template <typename T>
uint64_t digest_of(const std::vector<T>& v) {
  return ds::digest_tensor(ds::ConstTensorRef{"t", v.data(), v.size(), sizeof(T)});
}

std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// `count` distinct ascending positions below `numel`.
std::vector<int64_t> random_positions(uint64_t numel, uint64_t count, std::mt19937_64& rng) {
  std::vector<int64_t> all(numel);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(count);
  std::sort(all.begin(), all.end());
  return all;
}

}  // namespace

// Expected values come from an independent Python transcription of the definition in
// digest_mix.hpp; if one of these fails, every digest ever recorded has changed.
TEST(DigestKnownAnswer, Bf16) {
  const std::vector<uint16_t> v = {0x0000, 0x8000, 0x3F80, 0xBF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x1234, 0x0001};
  EXPECT_EQ(ds::digest_to_hex(digest_of(v)), "d905bd55e81c5087");
}

TEST(DigestKnownAnswer, U8) {
  std::vector<uint8_t> v;
  for (int b = 0; b < 256; b += 17) v.push_back(static_cast<uint8_t>(b));
  EXPECT_EQ(ds::digest_to_hex(digest_of(v)), "e2013652bf955f2e");
}

TEST(DigestKnownAnswer, F32) {
  const std::vector<uint32_t> v = {0x00000000, 0x80000000, 0x3F800000, 0x7FC00000, 0x7FC00001, 0xFFFFFFFF};
  EXPECT_EQ(ds::digest_to_hex(digest_of(v)), "98716f535b8bd78f");
}

TEST(DigestKnownAnswer, PositionsBeyond2To32) {
  namespace mix = ds::digest_mix;
  EXPECT_EQ(mix::term_at(2, (uint64_t{1} << 32) + 5, 0x3F80), 0xdf09e086b4b21000ull);
  EXPECT_EQ(mix::term_at(2, (uint64_t{7} << 32) + 0xFFFFFFFFull, 0xBF80), 0xf2f8a4585350977full);
}

TEST(Digest, EmptyTensorIsZero) {
  EXPECT_EQ(ds::digest_tensor(ds::ConstTensorRef{"e", nullptr, 0, 2}), 0u);
}

TEST(Digest, AnyChunkingAndOrderGivesTheSameDigest) {
  for (uint32_t width : {1u, 2u, 4u}) {
    SCOPED_TRACE(width);
    const uint64_t numel = 3'000'017;  // several parallel chunks plus a ragged tail
    const auto bytes = random_bytes(numel * width, 11 + width);
    const uint64_t whole = ds::digest_tensor(ds::ConstTensorRef{"t", bytes.data(), numel, width});

    EXPECT_EQ(ds::digest_slice(width, bytes.data(), 0, numel), whole);

    std::mt19937_64 rng(width);
    for (int trial = 0; trial < 5; ++trial) {
      std::vector<uint64_t> cuts = {0, numel};
      for (int c = 0; c < 1 + trial * 7; ++c) cuts.push_back(rng() % numel);
      std::sort(cuts.begin(), cuts.end());
      std::vector<size_t> order(cuts.size() - 1);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      uint64_t sum = 0;
      for (size_t s : order) sum += ds::digest_slice(width, bytes.data() + cuts[s] * width, cuts[s], cuts[s + 1] - cuts[s]);
      EXPECT_EQ(sum, whole) << "trial " << trial;
    }

    // Element by element in a random order, through the scalar path.
    std::vector<int64_t> perm(numel);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<uint8_t> permuted(bytes.size());
    for (uint64_t k = 0; k < numel; ++k) std::memcpy(&permuted[k * width], &bytes[perm[k] * width], width);
    EXPECT_EQ(ds::digest_scattered(width, numel, perm.data(), 8, permuted.data()), whole);
  }
}

TEST(Digest, AnyThreadCountGivesTheSameDigest) {
  // Slices summed by 1, 3 or 7 threads of our own (not the pool), in whatever order they finish.
  const uint64_t numel = 1'000'003;
  const auto bytes = random_bytes(numel * 2, 5);
  const uint64_t whole = ds::digest_tensor(ds::ConstTensorRef{"t", bytes.data(), numel, 2});
  for (unsigned threads : {1u, 3u, 7u}) {
    std::atomic<uint64_t> sum{0};
    std::vector<std::thread> pool;
    for (unsigned k = 0; k < threads; ++k)
      pool.emplace_back([&, k] {
        const uint64_t first = numel * k / threads, last = numel * (k + 1) / threads;
        sum.fetch_add(ds::digest_slice(2, bytes.data() + first * 2, first, last - first));
      });
    for (auto& th : pool) th.join();
    EXPECT_EQ(sum.load(), whole) << threads << " threads";
  }
}

TEST(Digest, SetOfTensorsMatchesOneByOne) {
  std::vector<std::vector<uint8_t>> storage;
  std::vector<ds::ConstTensorRef> refs;
  const uint64_t sizes[] = {1, 7, 4096, 1'048'576, 1'048'577, 0, 2'500'001};
  const uint32_t widths[] = {2, 1, 4, 2, 2, 2, 1};
  for (size_t t = 0; t < std::size(sizes); ++t) storage.push_back(random_bytes(sizes[t] * widths[t], 100 + t));
  for (size_t t = 0; t < std::size(sizes); ++t) refs.push_back({"t", storage[t].data(), sizes[t], widths[t]});
  const auto all = ds::digest_tensors(refs);
  ASSERT_EQ(all.size(), refs.size());
  for (size_t t = 0; t < refs.size(); ++t) {
    EXPECT_EQ(all[t], ds::digest_tensor(refs[t])) << t;
    EXPECT_EQ(all[t], ds::digest_slice(widths[t], storage[t].data(), 0, sizes[t])) << t;
  }
}

TEST(Digest, UpdateEqualsRecomputeAfterRandomPatches) {
  for (uint32_t width : {1u, 2u, 4u}) {
    SCOPED_TRACE(width);
    std::mt19937_64 rng(1000 + width);
    const uint64_t numel = 200'003;
    auto bytes = random_bytes(numel * width, width);
    ds::ConstTensorRef ref{"t", bytes.data(), numel, width};
    uint64_t digest = ds::digest_tensor(ref);
    for (int step = 0; step < 6; ++step) {
      const uint64_t count = step == 0 ? 0 : rng() % (numel / (step * 3));
      const auto idx = random_positions(numel, count, rng);
      const auto new_bits = random_bytes(count * width, rng());
      std::vector<uint8_t> old_bits(count * width);
      for (uint64_t k = 0; k < count; ++k) std::memcpy(&old_bits[k * width], &bytes[idx[k] * width], width);
      for (uint64_t k = 0; k < count; ++k) std::memcpy(&bytes[idx[k] * width], &new_bits[k * width], width);

      const uint64_t updated = ds::digest_update(digest, width, count, idx.data(), old_bits.data(), new_bits.data());
      EXPECT_EQ(updated, ds::digest_tensor(ref)) << "step " << step;

      // The PatchRef forms, with int32 indices as files store them.
      std::vector<int32_t> idx32(idx.begin(), idx.end());
      const ds::PatchRef patch{count, idx32.data(), 4, new_bits.data(), width};
      EXPECT_EQ(ds::digest_update(digest, patch, old_bits.data()), updated);
      const void* olds[] = {old_bits.data()};
      EXPECT_EQ(digest + ds::digest_shifts(std::span(&patch, 1), olds).front(), updated);
      EXPECT_EQ(ds::digest_at(ref, count, idx.data(), 8), ds::digest_scattered(width, count, idx.data(), 8, new_bits.data()));
      digest = updated;
    }
  }
}

TEST(Digest, EveryBitPatternCounts) {
  // ±0 and NaN payloads are different weights to deltasync: digests must tell them apart.
  std::vector<uint16_t> a(1000, 0x3C00);
  auto b = a;
  a[500] = 0x0000;
  b[500] = 0x8000;
  EXPECT_NE(digest_of(a), digest_of(b));
  a[500] = 0x7FC0;
  b[500] = 0x7FC1;
  EXPECT_NE(digest_of(a), digest_of(b));
  std::vector<uint32_t> f(64, 0x7FC00000);
  auto g = f;
  g[3] = 0x7FC00002;
  EXPECT_NE(digest_of(f), digest_of(g));
}

TEST(Digest, SingleElementChangesAreAlwaysSeen) {
  // term(i, ·) is injective for a fixed position: every one-element change moves the digest.
  std::vector<uint8_t> v(300, 0);
  const uint64_t base = digest_of(v);
  for (int pos : {0, 1, 150, 299})
    for (int bits = 1; bits < 256; ++bits) {
      v[pos] = static_cast<uint8_t>(bits);
      ASSERT_NE(digest_of(v), base) << pos << " " << bits;
      v[pos] = 0;
    }
}

TEST(Digest, SwappingElementsChangesTheDigest) {
  std::vector<uint16_t> v(4096);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint16_t>(i * 7919);
  const uint64_t base = digest_of(v);
  std::swap(v[10], v[11]);
  EXPECT_NE(digest_of(v), base);
  std::swap(v[10], v[11]);
  std::reverse(v.begin(), v.end());
  EXPECT_NE(digest_of(v), base);
}

TEST(Digest, WidthIsPartOfTheDigest) {
  const std::vector<uint8_t> bytes(64, 0);
  const uint64_t as_u8 = ds::digest_slice(1, bytes.data(), 0, 64);
  const uint64_t as_bf16 = ds::digest_slice(2, bytes.data(), 0, 32);
  const uint64_t as_f32 = ds::digest_slice(4, bytes.data(), 0, 16);
  EXPECT_NE(as_u8, as_bf16);
  EXPECT_NE(as_bf16, as_f32);
  EXPECT_NE(as_u8, as_f32);
}

TEST(Digest, SlicesStraddlingA2To32BlockMatchElementTerms) {
  // No tensor of 2^32 elements is allocated: a slice can start anywhere, so start it just below
  // the boundary and compare with element-by-element terms.
  for (uint32_t width : {1u, 2u, 4u}) {
    const auto bytes = random_bytes(40 * width, 7 * width);
    const uint64_t first = (uint64_t{3} << 32) - 17;
    std::vector<int64_t> positions(40);
    std::iota(positions.begin(), positions.end(), static_cast<int64_t>(first));
    EXPECT_EQ(ds::digest_slice(width, bytes.data(), first, 40),
              ds::digest_scattered(width, 40, positions.data(), 8, bytes.data()))
        << width;
    // The same bits one block further down hash differently.
    EXPECT_NE(ds::digest_slice(width, bytes.data(), first, 40),
              ds::digest_slice(width, bytes.data(), first - (uint64_t{1} << 32), 40));
  }
}

TEST(Digest, RejectsUnsupportedWidths) {
  const std::vector<uint64_t> v(4, 1);
  EXPECT_THROW(ds::digest_tensor(ds::ConstTensorRef{"w64", v.data(), 4, 8}), ds::Error);
  EXPECT_THROW(ds::digest_tensor(ds::ConstTensorRef{"w3", v.data(), 4, 3}), ds::Error);
  try {
    ds::digest_tensor(ds::ConstTensorRef{"w64", v.data(), 4, 8});
  } catch (const ds::Error& e) {
    EXPECT_NE(std::string(e.what()).find("w64"), std::string::npos) << e.what();
  }
}

TEST(DigestHex, RoundTrips) {
  for (uint64_t d : {0ull, 1ull, 0xFFFFFFFFFFFFFFFFull, 0x0123456789ABCDEFull, 0xD905BD55E81C5087ull}) {
    const std::string hex = ds::digest_to_hex(d);
    EXPECT_EQ(hex.size(), 16u);
    EXPECT_EQ(ds::digest_from_hex(hex, "x"), d);
  }
  EXPECT_EQ(ds::digest_to_hex(0x0123456789abcdefull), "0123456789abcdef");
}

TEST(DigestHex, RejectsAnythingButSixteenLowercaseHexDigits) {
  for (const char* bad : {"", "0123456789abcde", "0123456789abcdef0", "0123456789ABCDEF", "0x23456789abcdef",
                          "0123456789abcdeg", " 123456789abcdef", "0123456789abcde\n"}) {
    EXPECT_THROW(ds::digest_from_hex(bad, "f.safetensors"), ds::Error) << bad;
  }
  try {
    ds::digest_from_hex("XYZ", "f.safetensors");
    FAIL();
  } catch (const ds::Error& e) {
    EXPECT_EQ(std::string(e.what()), "f.safetensors: digest 'XYZ': not 16 lowercase hex digits");
  }
}
