// Helpers shared by the compact codec tests (CPU codec, GPU codec, two-phase decode): a small
// model with base and current bits and the CPU delta between them, reproducible weight-like or
// arbitrary base bits, the three kinds of change the codec must carry, and an encoded tensor
// whose block index a test edits field by field to build corrupt payloads; the format's hybrid
// integer split, from the page.
// Everything is inline in namespace compact_test; a test file says `using namespace
// compact_test;` once and uses the names as its own.
#pragma once
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "codec/compact_codec.hpp"
#include "engine/cpu_engine.hpp"

namespace compact_test {

// The hybrid integer of docs/compact-format.md, written from the page (the codec's token paths
// are checked against it): v < 16 is its own token; else, with n = floor(log2 v), the token is
// 16 + 4(n - 4) + the two bits under the leading one and the n - 2 bits under those are raw.
struct HybridInteger {
  uint32_t token = 0;
  uint32_t raw_bits = 0;
  uint64_t raw = 0;
};
inline HybridInteger hybrid_integer(uint64_t v) {
  if (v < 16) return {static_cast<uint32_t>(v), 0, 0};
  const uint32_t n = 63u - static_cast<uint32_t>(std::countl_zero(v));
  return {16u + 4u * (n - 4u) + static_cast<uint32_t>((v >> (n - 2)) & 3u), n - 2u, v & ((uint64_t{1} << (n - 2)) - 1)};
}

// A model: metadata plus base and current bits, and the delta between them.
struct Model {
  std::vector<deltasync::TensorMeta> meta;
  std::vector<std::vector<uint8_t>> base, current;
  deltasync::SparseDelta delta;

  // A 1-D tensor whose base and current bits are all zero.
  void add(std::string name, deltasync::DType dtype, uint64_t numel) { add_shaped(std::move(name), dtype, {numel}); }
  // The same of any shape (two or more dimensions: the codec may cut it into tiles).
  void add_shaped(std::string name, deltasync::DType dtype, std::vector<uint64_t> shape) {
    meta.push_back({std::move(name), dtype, std::move(shape)});
    base.emplace_back(meta.back().numel() * deltasync::dtype_width(dtype));
    current.emplace_back(meta.back().numel() * deltasync::dtype_width(dtype));
  }
  // Runs the CPU encode on a copy of the base (the shadow), filling `delta`; the base itself
  // stays as it was, for the decode to read.
  void encode() {
    std::vector<std::vector<uint8_t>> shadow = base;
    std::vector<deltasync::EncodeItem> items;
    for (size_t t = 0; t < meta.size(); ++t)
      items.push_back({meta[t].name, current[t].data(), shadow[t].data(), meta[t].numel(), meta[t].width()});
    deltasync::cpu::encode(items, delta);
  }
  std::vector<deltasync::ConstTensorRef> base_refs() const {
    std::vector<deltasync::ConstTensorRef> refs;
    for (size_t t = 0; t < meta.size(); ++t) refs.push_back({meta[t].name, base[t].data(), meta[t].numel(), meta[t].width()});
    return refs;
  }
};

// Element i of a tensor of width w (1, 2 or 4 bytes, little-endian) as an integer, and back.
inline uint32_t load(const std::vector<uint8_t>& bytes, uint64_t i, uint32_t w) {
  uint32_t v = 0;
  std::memcpy(&v, bytes.data() + i * w, w);
  return v;
}
inline void store(std::vector<uint8_t>& bytes, uint64_t i, uint32_t w, uint32_t v) {
  std::memcpy(bytes.data() + i * w, &v, w);
}

// Random base bits for a weight-like tensor (floats near ±0.02 with some exact ±0), or fully
// random bits (NaN payloads, ±0, infinities).
inline void fill_base(std::vector<uint8_t>& bytes, uint32_t w, std::mt19937_64& rng, bool any_bits) {
  for (uint64_t i = 0; i < bytes.size() / w; ++i) {
    uint32_t v = static_cast<uint32_t>(rng());
    if (!any_bits && w >= 2) {
      const float f = (rng() % 50 == 0) ? 0.0f : std::ldexp(1.0f + (rng() % 1000) / 1000.0f, -6 - int(rng() % 6));
      uint32_t f32;
      std::memcpy(&f32, &f, 4);
      if (rng() & 1) f32 |= 0x80000000u;
      v = w == 4 ? f32 : (f32 >> 16);  // bf16 truncation (F16 gets arbitrary but valid bits)
    }
    store(bytes, i, w, v);  // the low w bytes: 1-byte dtypes keep random bits
  }
}

// How the current bits of a changed element differ from the base.
enum class Change { Ulp, Random, SignFlip };

// Sets tensor t's current bits to its base bits with each element changed with probability
// `density`, in the way `kind` says. A change always changes the bits.
inline void make_changes(Model& m, size_t t, double density, Change kind, std::mt19937_64& rng) {
  namespace compact = deltasync::compact;
  const uint32_t w = m.meta[t].width();
  const uint64_t n = m.meta[t].numel();
  m.current[t] = m.base[t];
  std::bernoulli_distribution pick(density);
  for (uint64_t i = 0; i < n; ++i) {
    if (!pick(rng)) continue;
    const uint32_t old = load(m.base[t], i, w);
    uint32_t v = old;
    switch (kind) {
      case Change::Ulp: {
        // ±1 or ±2 steps of the ordered pattern: crosses signs and exponents where they lie.
        const int step = (rng() & 1 ? 1 : -1) * (rng() % 8 == 0 ? 2 : 1);
        v = compact::from_ordered((compact::to_ordered(old, w) + static_cast<uint32_t>(step)) & compact::width_mask(w), w);
        break;
      }
      case Change::Random: v = static_cast<uint32_t>(rng()) & compact::width_mask(w); break;
      case Change::SignFlip: v = old ^ (1u << (8 * w - 1)); break;
    }
    if (v == old) v ^= 1;
    store(m.current[t], i, w, v);
  }
}

// The model the "every dtype, density and kind of change" tests sweep: a 20000-element tensor,
// an empty one and a 257-element one, with random base bits (any bits for random changes, else
// weight-like) and changes of `kind` at `density`.
inline Model sweep_model(deltasync::DType dtype, double density, Change kind, std::mt19937_64& rng) {
  Model m;
  m.add("w", dtype, 20000);
  m.add("empty", dtype, 0);
  m.add("norm", dtype, 257);
  for (size_t t = 0; t < m.meta.size(); ++t) {
    fill_base(m.base[t], m.meta[t].width(), rng, kind == Change::Random);
    make_changes(m, t, density, kind, rng);
  }
  return m;
}
// Names one case of the sweep, for SCOPED_TRACE.
inline std::string sweep_case(deltasync::DType dtype, double density, Change kind) {
  return std::string(deltasync::dtype_name(dtype)) + " density " + std::to_string(density) + " kind " +
         std::to_string(int(kind));
}

// A model of tensors that the writers cut into tiles at `density` with blocks of `block`: a
// [rows, cols] matrix, a 3-D tensor (rows = its first two dimensions), a 1-D tensor (never tiled)
// and one whose columns no power of two above 1 divides (stripes only), with weight-like bits
// and one-ulp changes.
inline Model tiled_model(deltasync::DType dtype, double density, std::mt19937_64& rng) {
  Model m;
  m.add_shaped("mlp.w", dtype, {192, 96});
  m.add_shaped("experts.w", dtype, {4, 24, 64});
  m.add_shaped("norm", dtype, {300});
  m.add_shaped("odd.w", dtype, {64, 75});
  for (size_t t = 0; t < m.meta.size(); ++t) {
    fill_base(m.base[t], m.meta[t].width(), rng, false);
    make_changes(m, t, density, Change::Ulp, rng);
  }
  return m;
}

// What compact::decode reads: views of the encoder's output.
inline std::vector<deltasync::compact::EncodedTensorView> views_of(
    const std::vector<deltasync::compact::EncodedTensor>& encoded) {
  std::vector<deltasync::compact::EncodedTensorView> views;
  for (const auto& e : encoded) views.push_back(e.view());
  return views;
}

// An encoded tensor whose block index a test edits by the documented field offsets
// (docs/compact-format.md): a 24-byte header (32 in index version 2), then one 32-byte record a block.
struct EditableTensor {
  deltasync::compact::EncodedTensor e;

  static constexpr size_t kHeaderChanged = 0, kHeaderPayload = 8, kHeaderBlocks = 20, kHeaderBands = 24, kHeaderStripes = 28;
  size_t record(size_t b) const { return deltasync::compact::index_header_bytes(e.index_version) + 32 * b; }
  static constexpr size_t kFirst = 0, kOffset = 8, kCount = 16, kTable = 20, kRans = 24, kBits = 28;

  template <typename T>
  T get(size_t at) const {
    T v;
    std::memcpy(&v, e.block_index.data() + at, sizeof v);
    return v;
  }
  template <typename T>
  void set(size_t at, T v) {
    std::memcpy(e.block_index.data() + at, &v, sizeof v);
  }
  template <typename T>
  void add(size_t at, int64_t delta) {
    set<T>(at, static_cast<T>(get<T>(at) + delta));
  }
  uint32_t blocks() const { return get<uint32_t>(kHeaderBlocks); }
  std::vector<deltasync::compact::EncodedTensorView> views() const { return {e.view()}; }

  // Flips one to three random bits, in the block index one time in four, else in the payload.
  void flip_random_bits(std::mt19937_64& rng) {
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) {
      auto& bytes = (rng() % 4 == 0) ? e.block_index : e.payload;
      bytes[rng() % bytes.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
    }
  }
};

// A 60-element BF16 tensor "layer.w" changed at positions 0 and 50, encoded: decoded against a
// base of 40 elements, the gap after position 0 leads outside the tensor.
inline deltasync::compact::EncodedTensor changes_at_0_and_50_of_60() {
  Model m;
  m.add("layer.w", deltasync::DType::BF16, 60);
  m.current[0] = m.base[0];
  store(m.current[0], 0, 2, 1);
  store(m.current[0], 50, 2, 1);
  m.encode();
  return deltasync::compact::encode(m.meta, m.delta.view()).at(0);
}

// A defect in a block index, and a fragment of the message a decoder must refuse it with.
struct BlockIndexDefect {
  const char* what;
  void (*apply)(EditableTensor&);
  const char* fragment;
};

// The block index defects that both the CPU decoder's tests and the GPU decoder's (same message
// as the CPU) refuse, listed once so that the twins check the same cases. For a tensor of fewer
// than 40000 elements encoded in blocks of 500 changes, at least three blocks.
inline const std::vector<BlockIndexDefect>& block_index_defects() {
  static const std::vector<BlockIndexDefect> defects = {
      {"offset outside the payload",
       [](EditableTensor& t) { t.set<uint64_t>(t.record(2) + t.kOffset, t.e.payload.size() + 100); },
       "block 2: payload offset"},
      {"overlapping blocks", [](EditableTensor& t) { t.set<uint64_t>(t.record(1) + t.kOffset, 0); },
       "block 1: payload offset 0"},
      {"a block's sizes run past the payload",
       [](EditableTensor& t) { t.add<uint32_t>(t.record(t.blocks() - 1) + t.kBits, 1); },
       "run past the end of the payload"},
      {"counts not summing to the header's total", [](EditableTensor& t) { t.add<uint64_t>(t.kHeaderChanged, -1); },
       "block counts sum to"},
      {"a count changed inside a block: its streams no longer match",
       [](EditableTensor& t) {
         t.set<uint32_t>(t.record(0) + t.kCount, 499);
         t.add<uint64_t>(t.kHeaderChanged, -1);
       },
       "block 0: "},
      {"zero count", [](EditableTensor& t) { t.set<uint32_t>(t.record(0) + t.kCount, 0); }, "block 0: count 0"},
      {"more blocks announced than present", [](EditableTensor& t) { t.set<uint32_t>(t.kHeaderBlocks, t.blocks() + 1); },
       "block index has"},
      {"first positions out of order",
       [](EditableTensor& t) { t.set<uint64_t>(t.record(2) + t.kFirst, t.get<uint64_t>(t.record(1) + t.kFirst)); },
       "block 2: first position"},
      {"a block that starts inside the previous one (found only after decoding)",
       [](EditableTensor& t) { t.set<uint64_t>(t.record(2) + t.kFirst, t.get<uint64_t>(t.record(1) + t.kFirst) + 1); },
       "block 2"},
      {"first position beyond the tensor",
       [](EditableTensor& t) { t.set<uint64_t>(t.record(t.blocks() - 1) + t.kFirst, 40000); }, "outside the tensor"},
  };
  return defects;
}

}  // namespace compact_test
