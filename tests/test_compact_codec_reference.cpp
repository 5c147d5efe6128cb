// The compact codec against a reference written straight from docs/compact-format.md: plain
// division in the rANS coder, one bit at a time for the raw bits, one change at a time. The
// production coder (reciprocal multiplication, vectorized and AVX-512 per-change passes, a
// 64-bit bit writer; a chunked decoder with padded, unchecked reads and a lagged base gather)
// must produce exactly these bytes and decode them back. The cases sit on the coder's internal
// boundaries (chunks of 16 and 32 changes, SIMD groups of 16, a gather lag of 64) and include
// gaps so large that a change's raw bits exceed one 64-bit read; tiled tensors follow the page's
// tiles (the rule, coded positions, blocks cut tile by tile).
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "codec/compact_codec.hpp"
#include "compact_test_support.hpp"
#include "core/error.hpp"

namespace ds = deltasync;
namespace compact = deltasync::compact;

namespace {

// ---- the reference encoder --------------------------------------------------------------------

using Split = compact_test::HybridInteger;
using compact_test::hybrid_integer;

struct Table {
  std::vector<uint32_t> freq, start;  // num_symbols entries
};

// "f = max(1, round(count·4096/total)); a shortfall goes to the first symbol of largest f; an
// excess is taken repeatedly from the first symbol of largest f, at most half of its f".
Table quantize(const std::vector<uint64_t>& counts) {
  Table t;
  uint64_t total = 0;
  size_t used = 0;
  for (size_t s = 0; s < counts.size(); ++s) {
    total += counts[s];
    if (counts[s]) used = s + 1;
  }
  t.freq.assign(used, 0);
  if (total == 0) return t;
  int64_t sum = 0;
  for (size_t s = 0; s < used; ++s)
    if (counts[s]) {
      t.freq[s] = static_cast<uint32_t>(std::max<uint64_t>(1, (counts[s] * 4096 + total / 2) / total));
      sum += t.freq[s];
    }
  const auto first_largest = [&] { return static_cast<size_t>(std::max_element(t.freq.begin(), t.freq.end()) - t.freq.begin()); };
  if (sum < 4096) t.freq[first_largest()] += static_cast<uint32_t>(4096 - sum);
  while (sum > 4096) {
    const size_t s = first_largest();
    const uint32_t take = std::max<uint32_t>(1, static_cast<uint32_t>(std::min<int64_t>(sum - 4096, t.freq[s] / 2)));
    t.freq[s] -= take;
    sum -= take;
  }
  uint32_t acc = 0;
  for (uint32_t f : t.freq) {
    t.start.push_back(acc);
    acc += f;
  }
  return t;
}

void put_varint(std::vector<uint8_t>& out, uint32_t v) {
  for (; v >= 0x80; v >>= 7) out.push_back(static_cast<uint8_t>(v | 0x80));
  out.push_back(static_cast<uint8_t>(v));
}

struct ReferenceBlock {
  uint32_t table_bytes = 0, rans_bytes = 0, bits_bytes = 0;
  std::vector<uint8_t> payload;
};

ReferenceBlock reference_block(const int64_t* positions, const uint8_t* new_bits, const uint8_t* base_bits,
                               uint32_t count, uint32_t w, uint32_t version) {
  std::vector<Split> gaps(count), values(count);
  std::vector<uint64_t> gap_counts(256, 0), value_counts(256, 0);
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t n = 0, b = 0;
    std::memcpy(&n, new_bits + size_t{i} * w, w);
    std::memcpy(&b, base_bits + size_t{i} * w, w);
    values[i] = hybrid_integer(compact::value_symbol(n, b, w));
    ++value_counts[values[i].token];
    if (i > 0) {
      gaps[i] = hybrid_integer(static_cast<uint64_t>(positions[i] - positions[i - 1] - 1));
      ++gap_counts[gaps[i].token];
    }
  }
  const Table gap_table = quantize(gap_counts), value_table = quantize(value_counts);

  ReferenceBlock block;
  for (const Table* t : {&gap_table, &value_table}) {
    put_varint(block.payload, static_cast<uint32_t>(t->freq.size()));
    for (uint32_t f : t->freq) put_varint(block.payload, f);
  }
  block.table_bytes = static_cast<uint32_t>(block.payload.size());

  if (version == compact::kFormatVersion1) {
    // rANS: reverse decode order, renormalize by bytes, then x = (x / f)·4096 + x % f + start.
    uint32_t x[4] = {1u << 23, 1u << 23, 1u << 23, 1u << 23};
    std::vector<uint8_t> emitted;  // in emission order; the stream holds them reversed
    const auto put = [&](int lane, const Table& t, uint32_t token) {
      const uint32_t f = t.freq.at(token);
      while (x[lane] >= (uint32_t{1} << 19) * f) {
        emitted.push_back(static_cast<uint8_t>(x[lane]));
        x[lane] >>= 8;
      }
      x[lane] = (x[lane] / f) * 4096 + x[lane] % f + t.start[token];
    };
    for (uint32_t i = count; i-- > 0;) {
      put(i % 2 ? 3 : 1, value_table, values[i].token);
      if (i > 0) put(i % 2 ? 2 : 0, gap_table, gaps[i].token);
    }
    std::vector<uint8_t> rans(16);
    for (int lane = 0; lane < 4; ++lane) std::memcpy(rans.data() + 4 * lane, &x[lane], 4);
    rans.insert(rans.end(), emitted.rbegin(), emitted.rend());
    block.rans_bytes = static_cast<uint32_t>(rans.size());
    block.payload.insert(block.payload.end(), rans.begin(), rans.end());
  } else {
    // Version 2: change i in lane i mod 32, states in [2^15, 2^31) renormalized by one 16-bit
    // word; decode order per group of 32: gap tokens lanes ascending, then value tokens.
    std::vector<uint32_t> x(32, 1u << 15);
    std::vector<uint16_t> emitted;  // in emission order; the stream holds them reversed
    const auto put = [&](uint32_t lane, const Table& t, uint32_t token) {
      const uint32_t f = t.freq.at(token);
      if (x[lane] >= (uint32_t{1} << 19) * f) {
        emitted.push_back(static_cast<uint16_t>(x[lane]));
        x[lane] >>= 16;
      }
      x[lane] = (x[lane] / f) * 4096 + x[lane] % f + t.start[token];
    };
    for (uint32_t group = (count + 31) / 32; group-- > 0;) {
      const uint32_t first = 32 * group, last = std::min(count, first + 32);
      for (uint32_t i = last; i-- > first;) put(i % 32, value_table, values[i].token);
      for (uint32_t i = last; i-- > first;)
        if (i > 0) put(i % 32, gap_table, gaps[i].token);
    }
    std::vector<uint8_t> rans(4 * 32);
    for (uint32_t lane = 0; lane < 32; ++lane) std::memcpy(rans.data() + 4 * lane, &x[lane], 4);
    for (auto it = emitted.rbegin(); it != emitted.rend(); ++it) {
      rans.push_back(static_cast<uint8_t>(*it));
      rans.push_back(static_cast<uint8_t>(*it >> 8));
    }
    block.rans_bytes = static_cast<uint32_t>(rans.size());
    block.payload.insert(block.payload.end(), rans.begin(), rans.end());
  }

  // Raw bits in decode order, LSB first, one at a time.
  std::vector<uint8_t> bits;
  uint64_t nbits = 0;
  const auto put_bits = [&](const Split& s) {
    for (uint32_t k = 0; k < s.raw_bits; ++k, ++nbits) {
      if (nbits % 8 == 0) bits.push_back(0);
      bits.back() |= static_cast<uint8_t>(((s.raw >> k) & 1) << (nbits % 8));
    }
  };
  for (uint32_t i = 0; i < count; ++i) {
    if (i > 0) put_bits(gaps[i]);
    put_bits(values[i]);
  }
  block.bits_bytes = static_cast<uint32_t>(bits.size());
  block.payload.insert(block.payload.end(), bits.begin(), bits.end());
  return block;
}

template <typename T>
T read_le(const std::vector<uint8_t>& bytes, size_t at) {
  T v;
  std::memcpy(&v, bytes.data() + at, sizeof v);
  return v;
}

// Encodes one tensor's changes with compact::encode and checks every block against the
// reference, then decodes against `base` and checks the changes come back.
void expect_version_matches_reference(const ds::TensorMeta& meta, const void* base, const std::vector<int64_t>& positions,
                                      const std::vector<uint8_t>& new_bits, const std::vector<uint8_t>& base_bits,
                                      uint32_t block_elements, uint32_t version);

void expect_matches_reference(const ds::TensorMeta& meta, const void* base, const std::vector<int64_t>& positions,
                              const std::vector<uint8_t>& new_bits, const std::vector<uint8_t>& base_bits,
                              uint32_t block_elements) {
  for (uint32_t version : {compact::kFormatVersion1, compact::kFormatVersion2}) {
    SCOPED_TRACE("compact_version " + std::to_string(version));
    expect_version_matches_reference(meta, base, positions, new_bits, base_bits, block_elements, version);
  }
}

void expect_version_matches_reference(const ds::TensorMeta& meta, const void* base, const std::vector<int64_t>& positions,
                                      const std::vector<uint8_t>& new_bits, const std::vector<uint8_t>& base_bits,
                                      uint32_t block_elements, uint32_t version) {
  const uint32_t w = meta.width();
  ds::SparseDelta delta;
  delta.offsets = {0, positions.size()};
  delta.value_offsets = {0, new_bits.size()};
  delta.indices = positions;
  delta.values = new_bits;
  delta.base_values = base_bits;
  compact::Options options;
  options.block_elements = block_elements;
  options.version = version;
  const std::vector<ds::TensorMeta> metas{meta};
  const auto encoded = compact::encode(metas, delta.view(), options);
  ASSERT_EQ(encoded.size(), 1u);
  const auto& e = encoded[0];

  const uint32_t num_blocks = read_le<uint32_t>(e.block_index, 20);
  ASSERT_EQ(num_blocks, (positions.size() + block_elements - 1) / block_elements);
  // The writers' default is index version 2 (32-byte header: a 1-D tensor has one tile).
  ASSERT_EQ(e.index_version, compact::kIndexVersion2);
  EXPECT_EQ(read_le<uint32_t>(e.block_index, 24), 1u);
  EXPECT_EQ(read_le<uint32_t>(e.block_index, 28), 1u);
  size_t offset = 0;
  for (uint32_t b = 0; b < num_blocks; ++b) {
    const size_t first = size_t{b} * block_elements;
    const uint32_t count = static_cast<uint32_t>(std::min<size_t>(block_elements, positions.size() - first));
    const ReferenceBlock ref =
        reference_block(positions.data() + first, new_bits.data() + first * w, base_bits.data() + first * w, count, w,
                        version);
    const size_t record = 32 + 32 * size_t{b};
    EXPECT_EQ(read_le<uint64_t>(e.block_index, record), static_cast<uint64_t>(positions[first])) << "block " << b;
    EXPECT_EQ(read_le<uint64_t>(e.block_index, record + 8), offset) << "block " << b;
    EXPECT_EQ(read_le<uint32_t>(e.block_index, record + 16), count) << "block " << b;
    EXPECT_EQ(read_le<uint32_t>(e.block_index, record + 20), ref.table_bytes) << "block " << b;
    EXPECT_EQ(read_le<uint32_t>(e.block_index, record + 24), ref.rans_bytes) << "block " << b;
    EXPECT_EQ(read_le<uint32_t>(e.block_index, record + 28), ref.bits_bytes) << "block " << b;
    ASSERT_LE(offset + ref.payload.size(), e.payload.size());
    EXPECT_TRUE(std::equal(ref.payload.begin(), ref.payload.end(), e.payload.begin() + static_cast<ptrdiff_t>(offset)))
        << "block " << b << " of " << count << " changes differs from the reference bytes";
    offset += ref.payload.size();
  }
  EXPECT_EQ(offset, e.payload.size());

  const std::vector<compact::EncodedTensorView> views{e.view()};
  const std::vector<ds::ConstTensorRef> refs{{meta.name, base, meta.numel(), w}};
  compact::DecodedDelta decoded;
  compact::decode(views, metas, refs, "mem", decoded);
  EXPECT_EQ(decoded.storage.indices, positions);
  EXPECT_EQ(decoded.storage.values, new_bits);
  EXPECT_EQ(decoded.storage.base_values, base_bits);
}

struct Case {
  ds::DType dtype;
  double density;
  bool random_values;  // else ±1..2 steps of the ordered pattern
};

}  // namespace

TEST(CompactReference, EncoderBytesEqualTheSpecOnChunkAndLagBoundaries) {
  std::mt19937_64 rng(31);
  const Case cases[] = {{ds::DType::BF16, 0.01, false}, {ds::DType::BF16, 0.3, true}, {ds::DType::F32, 0.003, true},
                        {ds::DType::F8_E4M3, 0.05, true}, {ds::DType::F16, 1.0, false}};
  const uint32_t block_sizes[] = {1, 2, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 129, 1000, 16384};
  for (const Case& c : cases) {
    const ds::TensorMeta meta{"t", c.dtype, {20000}};
    const uint32_t w = meta.width();
    std::vector<uint8_t> base(meta.numel() * w);
    for (auto& byte : base) byte = static_cast<uint8_t>(rng());
    std::vector<int64_t> positions;
    std::vector<uint8_t> new_bits, base_bits;
    std::bernoulli_distribution pick(c.density);
    for (uint64_t i = 0; i < meta.numel(); ++i) {
      if (!pick(rng)) continue;
      uint32_t old = 0;
      std::memcpy(&old, base.data() + i * w, w);
      // A few random values among ulp steps give tokens seen once in a block: at 16384 changes
      // per block their frequency is 1, the reciprocal coder's special case.
      const bool random_value = c.random_values || positions.size() % 5000 == 4999;
      uint32_t v = random_value ? static_cast<uint32_t>(rng()) & compact::width_mask(w)
                                   : compact::from_ordered((compact::to_ordered(old, w) + (rng() & 1 ? 1u : 0u - 2u)) &
                                                               compact::width_mask(w),
                                                           w);
      if (v == old) v ^= 1;
      positions.push_back(static_cast<int64_t>(i));
      new_bits.insert(new_bits.end(), reinterpret_cast<uint8_t*>(&v), reinterpret_cast<uint8_t*>(&v) + w);
      base_bits.insert(base_bits.end(), base.data() + i * w, base.data() + (i + 1) * w);
    }
    ASSERT_GT(positions.size(), 40u);
    for (uint32_t block : block_sizes) {
      SCOPED_TRACE(std::string(ds::dtype_name(c.dtype)) + " density " + std::to_string(c.density) + " block " +
                   std::to_string(block));
      expect_matches_reference(meta, base.data(), positions, new_bits, base_bits, block);
    }
  }
}

TEST(CompactReference, GapsWhoseRawBitsExceedOneRead) {
  // Gaps of ~2^31 (29 raw bits) and above 2^32 next to random F32 values (up to 29 raw bits): more raw bits
  // per change than one 64-bit read serves. The base is a read-only mapping of zeros that is
  // never written, so it costs address space only.
  const uint64_t numel = uint64_t{1} << 38;
  const uint32_t w = 4;
  void* mapping = mmap(nullptr, numel * w, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mapping == MAP_FAILED) GTEST_SKIP() << "cannot reserve " << numel * w << " bytes of address space";
  std::mt19937_64 rng(5);
  std::vector<int64_t> positions;
  std::vector<uint8_t> new_bits, base_bits;
  int64_t p = static_cast<int64_t>(rng() % 1000);
  while (positions.size() < 70) {
    positions.push_back(p);
    const uint32_t v = static_cast<uint32_t>(rng()) | 1u;  // never equal to the zero base bits
    new_bits.insert(new_bits.end(), reinterpret_cast<const uint8_t*>(&v), reinterpret_cast<const uint8_t*>(&v) + w);
    base_bits.insert(base_bits.end(), w, 0);
    // Mostly huge gaps, some of 2^32 and more (the SIMD first pass leaves their groups to the
    // scalar loop), sometimes adjacent or small ones.
    const uint64_t kind = rng() % 5;
    p += 1 + static_cast<int64_t>(kind == 0   ? 0
                                  : kind == 1 ? rng() % 300
                                  : kind == 4 ? (uint64_t{1} << 32) + rng() % (uint64_t{1} << 32)
                                              : (uint64_t{1} << 31) + rng() % (uint64_t{1} << 30));
  }
  const ds::TensorMeta meta{"huge", ds::DType::F32, {numel}};
  for (uint32_t block : {16u, 33u, 70u}) {
    SCOPED_TRACE("block " + std::to_string(block));
    expect_matches_reference(meta, mapping, positions, new_bits, base_bits, block);
  }
  munmap(mapping, numel * w);
}

// Tiles, from the page (docs/compact-format.md, "Tiles"): the rule's bands and stripes, coded
// positions q = k*R*W + r*W + c mod W, the changes in ascending q, blocks cut tile by tile, each
// coded by the reference against the base bits at its flat position. Written here from the text,
// not from compact_tiles.hpp.
TEST(CompactReference, TiledTensorsFollowThePage) {
  std::mt19937_64 rng(77);
  struct Shape {
    uint64_t rows, cols;
    uint32_t block;
  };
  // Bands and stripes; stripes alone (75 columns); blocks above 4096 changes (tiles of 4096).
  for (const Shape s : {Shape{96, 64, 16}, Shape{40, 75, 8}, Shape{256, 512, 8192}}) {
    const uint64_t R = s.rows, C = s.cols, numel = R * C;
    const ds::TensorMeta meta{"t", ds::DType::BF16, {R, C}};
    std::vector<uint8_t> base(numel * 2);
    for (auto& byte : base) byte = static_cast<uint8_t>(rng());
    std::vector<int64_t> positions;
    std::vector<uint8_t> new_bits, base_bits;
    for (uint64_t p = 0; p < numel; ++p) {
      if (rng() % 4 != 0) continue;  // 25% changed
      positions.push_back(static_cast<int64_t>(p));
      uint16_t v = static_cast<uint16_t>(base[2 * p] | base[2 * p + 1] << 8);
      v = static_cast<uint16_t>(v + 1);
      new_bits.insert(new_bits.end(), {static_cast<uint8_t>(v), static_cast<uint8_t>(v >> 8)});
      base_bits.insert(base_bits.end(), {base[2 * p], base[2 * p + 1]});
    }
    const uint64_t n = positions.size();
    // The rule: grow bands and stripes together (each while <= 8 and dividing C, resp. R) while
    // every tile keeps at least min(block, 4096) changes on average.
    uint64_t bands = 1, stripes = 1;
    for (;;) {
      const bool b = bands * 2 <= 8 && C % (bands * 2) == 0, st = stripes * 2 <= 8 && R % (stripes * 2) == 0;
      const uint64_t next = bands * stripes * (b ? 2 : 1) * (st ? 2 : 1);
      if (next == bands * stripes || next > n / std::min<uint64_t>(s.block, 4096)) break;
      bands *= b ? 2 : 1;
      stripes *= st ? 2 : 1;
    }
    const uint64_t W = C / bands, H = R / stripes;
    struct Change {
      uint64_t q, p;
    };
    std::vector<Change> coded;
    for (uint64_t i = 0; i < n; ++i) {
      const auto p = static_cast<uint64_t>(positions[i]);
      const uint64_t r = p / C, c = p % C, k = c / W;
      coded.push_back({k * R * W + r * W + c % W, i});
    }
    std::sort(coded.begin(), coded.end(), [](const Change& a, const Change& b) { return a.q < b.q; });
    std::vector<int64_t> q_positions;
    std::vector<uint8_t> q_new, q_base;
    std::vector<uint64_t> tile_of;
    for (const Change& ch : coded) {
      q_positions.push_back(static_cast<int64_t>(ch.q));
      q_new.insert(q_new.end(), new_bits.begin() + 2 * ch.p, new_bits.begin() + 2 * ch.p + 2);
      q_base.insert(q_base.end(), base_bits.begin() + 2 * ch.p, base_bits.begin() + 2 * ch.p + 2);
      tile_of.push_back(ch.q / (R * W) * stripes + ch.q % (R * W) / W / H);
    }

    ds::SparseDelta delta;
    delta.offsets = {0, n};
    delta.value_offsets = {0, 2 * n};
    delta.indices = positions;
    delta.values = new_bits;
    delta.base_values = base_bits;
    compact::Options options;
    options.block_elements = s.block;
    const std::vector<ds::TensorMeta> metas{meta};
    const auto e = compact::encode(metas, delta.view(), options).at(0);
    SCOPED_TRACE(std::to_string(R) + " x " + std::to_string(C) + ", blocks of " + std::to_string(s.block));
    EXPECT_EQ(read_le<uint32_t>(e.block_index, 24), bands);
    EXPECT_EQ(read_le<uint32_t>(e.block_index, 28), stripes);
    size_t offset = 0, b = 0;
    for (uint64_t first = 0; first < n; ++b) {
      uint64_t count = 1;
      while (first + count < n && count < s.block && tile_of[first + count] == tile_of[first]) ++count;
      const ReferenceBlock ref = reference_block(q_positions.data() + first, q_new.data() + 2 * first, q_base.data() + 2 * first,
                                                 static_cast<uint32_t>(count), 2, compact::kFormatVersion1);
      const size_t record = 32 + 32 * b;
      ASSERT_LE(record + 32, e.block_index.size()) << "block " << b;
      EXPECT_EQ(read_le<uint64_t>(e.block_index, record), q_positions[first]) << "block " << b;
      EXPECT_EQ(read_le<uint32_t>(e.block_index, record + 16), count) << "block " << b;
      ASSERT_LE(offset + ref.payload.size(), e.payload.size());
      EXPECT_TRUE(std::equal(ref.payload.begin(), ref.payload.end(), e.payload.begin() + static_cast<ptrdiff_t>(offset))) << "block " << b;
      offset += ref.payload.size();
      first += count;
    }
    EXPECT_EQ(read_le<uint32_t>(e.block_index, 20), b);
    EXPECT_EQ(offset, e.payload.size());
    EXPECT_GT(bands * stripes, 1u);
  }
}
